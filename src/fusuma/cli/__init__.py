"""The `fusuma` command line: one module per command group."""
