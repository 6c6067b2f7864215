"""sdtrain: train latent text-to-image diffusion models, from one CPU to a cluster."""

import logging

__version__ = "0.1.0"

# peft imports bitsandbytes wherever it is installed, and bitsandbytes' CPU backend then warns, in every process
# (loader workers and their fork server too, which configure no logging), that an optional kernel package for its
# 4-bit matmul is missing: a matmul sdtrain never calls (a 4-bit base is dequantised a layer at a time,
# models/frozen.py). Set here, where every process that imports sdtrain passes first.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
