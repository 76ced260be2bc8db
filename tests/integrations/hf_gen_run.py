"""Stage 3 where Transformers expects DeepSpeed ZeRO-3 (issue 34), one torchrun run on a tiny Llama
saved and loaded back with ``from_pretrained``; writes a JSON (rank 0) with what each rank saw.

argv: out.json then key=value options: backend=zerocore|ddp, mode=lora|seq2seq, whole=0|1 (the config's
``stage3_gather_for_generation``).

- ``lora``: the model loaded partitioned (zerocore's ``from_pretrained`` at stage 3, plain
  ``from_pretrained`` under DDP), LoRA on q/v (PEFT), trained by the Trainer for 8 steps, then
  ``trainer.evaluate()`` on sequences of different lengths (each batch padded to its own longest:
  the ranks' batches differ in length), the frozen bytes each rank holds, and plain
  ``model.generate`` (PEFT's, no zerocore helper) with the ranks asking for different numbers of
  new tokens; rank 0 generates the same prompts with an unsharded copy of the trained weights.
- ``seq2seq``: ``Seq2SeqTrainer(predict_with_generate=True).predict`` before any training (on an
  engine that trains nothing, built by the prediction; each decoder layer a unit), each prompt's generation forced
  to end (EOS) after a number of tokens that depends on the prompt, so the ranks finish at different steps; rank 0
  generates each prompt alone with an unsharded copy of the weights. The stage-3 all-gathers issued are counted.
"""
import json
import os
import sys

import torch

import transformers
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_run import VOCAB, Tokens, tiny_model  # noqa: E402
from ddp_teardown import end_reference_run  # noqa: E402

EOS, PAD = 1, 0


def opts():
    o = dict(backend="zerocore", mode="lora", whole="0")
    for a in sys.argv[2:]:
        k, v = a.split("=", 1)
        o[k] = v
    return o


def zero_config(whole: bool = False, unit_min: int = 100_000):
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto",
                                  "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
                                  "stage3_gather_for_generation": whole, "stage3_unit_min_params": unit_min}}


def count_gathers() -> list:
    """Every stage-3 all-gather issued from now on appends to the list returned."""
    from zerocore.sharding.group import ShardedGroup

    seen, start = [], ShardedGroup.start_gather

    def counted(self, *args, **kwargs):
        seen.append(1)
        return start(self, *args, **kwargs)

    ShardedGroup.start_gather = counted
    return seen


class Ragged(torch.utils.data.Dataset):
    """Token sequences of lengths 5..16 (the collator pads each batch to its own longest)."""

    def __init__(self, n):
        base = Tokens(n).ids
        self.rows = [base[i, :5 + (7 * i) % 12] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_batch(items):
    n = max(len(x["input_ids"]) for x in items)
    ids = torch.full((len(items), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    for i, x in enumerate(items):
        ids[i, :len(x["input_ids"])] = x["input_ids"]
        mask[i, :len(x["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class EosAfter(LogitsProcessor):
    """Forces EOS once a row has ``1 + first prompt token % 6`` new tokens (prompts of ``prompt`` tokens)."""

    def __init__(self, prompt: int):
        self.prompt = prompt

    def __call__(self, input_ids, scores):
        want = 1 + input_ids[:, 0] % 6
        done = (input_ids.shape[1] - self.prompt) >= want
        scores = scores.clone()
        scores[done] = float("-inf")
        scores[done, EOS] = 0.0
        return scores


def args_for(work, **kw):
    a = dict(output_dir=os.path.join(work, "run"), per_device_train_batch_size=4, per_device_eval_batch_size=2,
             gradient_accumulation_steps=1, learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1,
             save_strategy="no", use_cpu=True, ddp_backend="gloo", report_to=[], seed=0, disable_tqdm=True,
             dataloader_num_workers=0)
    a.update(kw)
    return a


def unsharded(state: dict, lora: bool):
    """A plain copy of the trained model from its full state dict (PEFT's names for LoRA)."""
    model = tiny_model()
    if lora:
        model = lora_model(model)
    missing, unexpected = model.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    return model


def lora_model(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def run_lora(o, work, rank, world, result):
    src = os.path.join(work, "pretrained")
    if rank == 0:
        tiny_model().save_pretrained(src)
    torch.distributed.barrier()
    if o["backend"] == "zerocore":
        import zerocore.integrations.transformers as zt

        model = zt.from_pretrained(LlamaForCausalLM, src, zero_config())
        result["partitioned_at_load"] = sum(hasattr(p, "_zc_init") for p in model.parameters())
    else:
        model = LlamaForCausalLM.from_pretrained(src)
    model = lora_model(model)
    frozen_bytes = sum(p.numel() * 4 for p in tiny_model().parameters())  # the whole base, fp32
    args = transformers.TrainingArguments(**args_for(work, max_steps=8, warmup_steps=2, lr_scheduler_type="linear"))
    kw = dict(model=model, args=args, train_dataset=Tokens(8 * 4 * world), eval_dataset=Ragged(12),
              data_collator=pad_batch)
    if o["backend"] == "zerocore":
        from zerocore.integrations.transformers import ZeroTrainer

        trainer = ZeroTrainer(**kw, zerocore_config=zero_config())
    else:
        trainer = transformers.Trainer(**kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result.update(losses=[h["loss"] for h in logs], grad_norms=[h.get("grad_norm") for h in logs])
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    engine = getattr(trainer, "zerocore_engine", None)
    if engine is not None:
        rep = engine.memory_report()
        result["frozen_held"] = rep["frozen"]
        result["frozen_base"] = frozen_bytes
        state = engine.full_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prompt = Tokens(2).ids[:1, :4]
    n_new = [3 + 4 * r for r in range(world)]  # rank r asks for its own number of new tokens
    with torch.no_grad():  # plain generate, no zerocore helper: rank 0 finishes first and must keep joining
        ids = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new[rank],
                             min_new_tokens=n_new[rank], do_sample=False, pad_token_id=PAD)
    result["generated"] = gather_lists(ids[0].tolist())
    if rank == 0:
        ref = unsharded(state, lora=True)
        with torch.no_grad():
            result["reference"] = [ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                                max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                pad_token_id=PAD)[0].tolist() for n in n_new]
        result["weights"] = {k: v.reshape(-1)[:64].tolist() for k, v in state.items() if "lora_" in k}


def run_seq2seq(o, work, rank, world, result):
    model = tiny_model()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = model.config.pad_token_id = PAD  # the Trainer pads predictions with it
    args = transformers.Seq2SeqTrainingArguments(**args_for(work, predict_with_generate=True))
    prompts = Tokens(8).ids[:, :4].clone()
    prompts[:, 0] = torch.tensor([0, 1, 6, 5, 2, 7, 11, 4])  # 1..6 new tokens, unlike across the ranks' batches
    data = [{"input_ids": p, "attention_mask": torch.ones(4, dtype=torch.long), "labels": p.clone()} for p in prompts]
    if o["backend"] == "zerocore":
        from zerocore.integrations.transformers import make_zero_trainer

        trainer = make_zero_trainer(transformers.Seq2SeqTrainer)(model=model, args=args,
                                                                 zerocore_config=zero_config(o["whole"] == "1", 1000))
    else:
        trainer = transformers.Seq2SeqTrainer(model=model, args=args)
    gathers, calls = count_gathers(), []
    generate = type(model).generate
    type(model).generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    out = trainer.predict(data, max_new_tokens=8, logits_processor=LogitsProcessorList([EosAfter(4)]))
    result["predictions"] = out.predictions.tolist()
    # (the prediction before training ran on an engine that trains nothing: the evaluation engine)
    engine = getattr(trainer, "zerocore_eval_engine", None)
    if engine is not None:
        result.update(gathers=len(gathers), generate_calls=len(calls),
                      groups=sum(len(u.groups()) for u in engine.gatherer.units))
    result["stage3_engine"] = engine is not None and engine.config.zero_optimization.stage == 3
    state = engine.full_state_dict() if engine is not None else model.state_dict()
    if rank == 0:
        ref = unsharded(state, lora=False)
        ref.generation_config.eos_token_id = EOS
        ref.generation_config.pad_token_id = PAD
        with torch.no_grad():
            result["reference"] = [ref.generate(input_ids=p[None], attention_mask=torch.ones(1, 4, dtype=torch.long),
                                                max_new_tokens=8, do_sample=False,
                                                logits_processor=LogitsProcessorList([EosAfter(4)]))[0].tolist()
                                   for p in prompts]


def gather_lists(x: list) -> list:
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, x)
    return out


def main():
    out, o = sys.argv[1], opts()
    work = os.path.dirname(os.path.abspath(out))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    result = {}
    (run_lora if o["mode"] == "lora" else run_seq2seq)(o, work, rank, world, result)
    for key in ("frozen_held",):
        if key in result:
            result[key] = gather_lists(result[key])
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    if o["backend"] != "zerocore":
        end_reference_run()


if __name__ == "__main__":
    main()
