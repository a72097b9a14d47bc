"""The exactness tests' largest latent differences (engine against the diffusers pipeline), read
from their JUnit XML (`pytest --junitxml`, one file per dtype, named DTYPE.xml), as JSON and a
markdown table beside it: what `benchmarks/gpu.sh exactness` reports.

    python benchmarks/exactness_table.py OUT.json float32.xml bfloat16.xml
"""

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def cases(path: Path) -> dict[str, dict]:
    rows = {}
    for case in ET.parse(path).iter("testcase"):
        name = case.get("name").partition("[")[2].rstrip("]")
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        error = props.get("max_error")
        broken = case.find("failure") is not None or case.find("error") is not None
        rows[name] = {"max_error": None if error is None else float(error), "passed": not broken}
    return rows


def main(out: str, *xmls: str) -> None:
    results = {Path(x).stem: cases(Path(x)) for x in xmls if Path(x).is_file()}
    dtypes = list(results)
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))
    lines = ["| case | " + " | ".join(f"{d} max latent difference" for d in dtypes) + " |",
             "|---" * (1 + len(dtypes)) + "|"]
    for name in names:
        cells = []
        for d in dtypes:
            row = results[d].get(name)
            cells.append("-" if row is None or row["max_error"] is None else
                         f"{row['max_error']:.2e}" + ("" if row["passed"] else " (failed)"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    Path(out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:])
