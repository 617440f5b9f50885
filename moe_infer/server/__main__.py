"""`python -m moe_infer.server [overrides]`: the same as `moe-infer serve`."""
from moe_infer.server.launch import main

main()
