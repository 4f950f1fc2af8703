"""HH-RLHF pairs as unpaired (KTO-style) rows, for measuring a KTO run on real data (no unpaired file is shipped).

    python bench/hh_unpaired.py ../shared/data/preference/hh-rlhf_helpful-base_test.jsonl.gz /tmp/hh_unpaired.jsonl

Each pair becomes two rows ``{"prompt", "completion", "label"}``: the shared transcript prefix (through the last
common ``"\\n\\nAssistant:"``, ``rlhf_lit.data.records.split_hh_pair``), the chosen response labelled desirable
(true) and the rejected one undesirable (false), as ``rlhf_lit.data.demo_task.unpaired_rows`` does for the demo
task. Pairs with no shared prefix are left out (the loader would skip them too).
"""

from __future__ import annotations

import argparse
import gzip
import json

from rlhf_lit.data.records import split_hh_pair


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="HH-RLHF .jsonl.gz files, then the output .jsonl")
    args = ap.parse_args(argv)
    *inputs, out = args.inputs
    written = 0
    with open(out, "w") as f:
        for path in inputs:
            with gzip.open(path, "rt") as rows:
                for line in rows:
                    row = json.loads(line)
                    split = split_hh_pair(row["chosen"], row["rejected"])
                    if split is None:
                        continue
                    prompt, chosen, rejected = split
                    for completion, label in ((chosen, True), (rejected, False)):
                        f.write(json.dumps({"prompt": prompt, "completion": completion, "label": label}) + "\n")
                        written += 1
    print(f"{written} rows -> {out}")


if __name__ == "__main__":
    main()
