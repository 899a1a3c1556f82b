import sys
from vllm.v1.core.sched.scheduler import Scheduler
orig = Scheduler._mamba_block_aligned_split
def wrapped(self, request, num_new_tokens, *a):
    r = orig(self, request, num_new_tokens, *a)
    if (request.request_id in ("22",) and request.num_computed_tokens == 1568) or request.request_id == "0":
        print("SPLIT", self.mamba_has_prefill_checkpoint_blocks, self.mamba_prefill_checkpoint_alignment, self.use_eagle_block_drop, self.mamba_partial_cache_hit, self.hash_block_size, request.request_id, request.num_computed_tokens, num_new_tokens, a, r, request.num_tokens, request.num_prompt_tokens, file=open("/tmp/n0v/split.log","a"))
    return r
Scheduler._mamba_block_aligned_split = wrapped
from experiments.runners.vllm_virtual_worker import main
main()
