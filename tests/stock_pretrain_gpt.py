"""A stock-style Megatron pretraining script: it never imports dualpipe_megatron.

Run through ``python -m dualpipe_megatron.launch`` it gets ``--pipeline-schedule``; run on its
own, Megatron does not know that flag.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from pretrain_gpt import main  # noqa: E402  (model, data and forward step of a stock script)

if __name__ == "__main__":
    main()
