"""`python -m fusuma.supervisor PARTITION`: run a partition's supervisor."""

from fusuma.supervisor.daemon import main

main()
