"""Write tests/suite_costs.json from the per-test times of a full run.

``make test`` runs the suite on several workers, a test module at a time per worker
(tests/conftest.py); a worker that takes the longest modules first leaves the shortest
for the end, so both finish together. The order comes from this file: seconds per
module as measured, rounded. A stale or missing entry costs only balance, never a
result: a module it does not name is taken as `DEFAULT_S` long.

    python tools/suite_costs.py test-output/junit*.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "suite_costs.json"


def module_of(classname: str) -> str | None:
    """tests.integration.test_x[.TestClass] -> tests/integration/test_x.py."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (REPO / path).is_file():
            return path
    return None


def main(files: list[str]) -> None:
    costs: Counter[str] = Counter()
    for f in files:
        for case in ET.parse(f).iter("testcase"):
            mod = module_of(case.get("classname", ""))
            if mod is not None:
                costs[mod] += float(case.get("time") or 0)
    if not costs:
        sys.exit("no test times found in " + ", ".join(files))
    OUT.write_text(json.dumps({m: round(s) for m, s in sorted(costs.items())},
                              indent=0) + "\n")
    print(f"{OUT.relative_to(REPO)}: {len(costs)} modules, {round(sum(costs.values()))} s")


if __name__ == "__main__":
    main(sys.argv[1:] or [str(REPO / "test-output" / "junit.xml")])
