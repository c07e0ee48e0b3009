"""Write $DATA_DIR/math/{train,test}.parquet in verl's RL schema from Hendrycks MATH, the lighteval
release (DigitalLearningGmbH/MATH-lighteval): 7500 train + 5000 test rows; ground truth = the solution's last
``\\boxed{}``.

Online: `python scripts/data/math.py` (reads the dataset with the `datasets` library).
Offline: `python scripts/data/math.py --local-dir DIR` (parquet / json / jsonl files already downloaded).
Rows, prompt and answer extraction: `jetrl.tasks.parquet` and the dataset's module in `jetrl.tasks`.
"""

import os
import sys

# This folder holds math.py: as the script's folder it comes first on sys.path and would shadow the stdlib
# `math` for every import below (`python -P` avoids that too); drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from jetrl.tasks.parquet import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main("math"))
