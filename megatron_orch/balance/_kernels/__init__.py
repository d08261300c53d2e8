"""Compiled hot loops of the partitioners (numba, GIL released)."""
from megatron_orch.balance._kernels.local_search import (ABOVE_UPPER, METHOD_CODES, bs_ffd, fill_quotas, kk, lpt,
                                                         lpt_near_home, partition_groups, pigeonhole_bound, refine,
                                                         slot_lpt, swap_sweeps)
