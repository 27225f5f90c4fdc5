"""Synthesis time against device count and rank: meshes from 8 to 4096 devices, ranks 1-8.

Override on the command line, e.g. ``--config.problems_per_cell=5``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # axis:size lists, major to minor; ';' separates meshes. Primes up to 7, up to 4096 devices.
    c.meshes = ";".join(
        [
            "a:2,b:2,c:2",
            "x:4,y:4,z:4",
            "x:3,y:5,z:7",
            "x:4,y:8,z:8",
            "data:16,fsdp:8,tensor:8",
            "x:12,y:10,z:7,w:4",
            "w:8,x:8,y:8,z:8",
            "data:32,fsdp:16,tensor:8",
        ]
    )
    c.ranks = "1,2,3,4,5,6,7,8"
    c.problems_per_cell = 12
    c.max_elems = 2**34  # global sizes are log-uniform up to this (nothing is allocated)
    c.dtype = "float32"
    c.cost_model = "bytes"
    c.seed = 0
    c.figures = True
    return c
