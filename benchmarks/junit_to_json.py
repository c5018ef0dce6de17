"""pytest's JUnit XML as JSON (counts, and every failed, errored or skipped test with its message): gpu_suite.sh.

    python benchmarks/junit_to_json.py OUTDIR/tests.xml OUTDIR/tests.json
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET


def convert(xml_path: str) -> dict:
    """Counts per outcome and the non-passing cases; a missing file (pytest killed by the time limit) says so."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"error": f"no JUnit XML from pytest ({type(e).__name__}: {e}): killed by the time limit?"}
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        message = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (node.get("message") or node.text or "")[:500]
                break
        counts[outcome] += 1
        if outcome != "passed":
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                          "message": message})
    return {"counts": counts, "not_passed": cases, "ok": counts["failed"] == 0 and counts["error"] == 0}


if __name__ == "__main__":
    result = convert(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(0 if result.get("ok") else 1)
