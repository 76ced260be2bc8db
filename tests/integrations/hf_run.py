"""One Hugging Face Trainer run under torchrun (or alone) on a tiny Llama built from its config,
with a tokenizer-free synthetic dataset. Writes a JSON with the logged losses, learning rates,
gradient norms, the final weights and checks of what was saved.

argv: out.json then key=value options: backend=ddp|zerocore|deepspeed (DeepSpeed itself through
TrainingArguments(deepspeed=config), the config zerocore gets) stage=2 sched=<DeepSpeed scheduler type: the
config gets "optimizer" and "scheduler" sections of "auto"s> bf16=0|1 master=given|rounded gc=0|1 (the
Trainer's gradient_checkpointing) compile=<a dynamo backend: the Trainer's torch_compile>
unit_min=<stage3_unit_min_params: 1000 makes each decoder layer a unit> oom=1 (auto_find_batch_size: the
second forward at batch 4, after the first's backward, raises the CPU allocator's out-of-memory error; the
Trainer retries at batch 2) bs=<per-device batch, 4> neftune=<the Trainer's neftune_noise_alpha> offload=0|1
eval_first=1 (trainer.evaluate() before train: its loss and, for zerocore, the engine it ran on are reported)
eval_only=1 (evaluate and predict, then save_model, no training) reads=1 (zerocore: the run inside
zerocore.debug.partitioned_reads(); the uses it names are reported)
steps=30
save_steps=0 resume=<checkpoint dir> trainer=trainer|sft lora=0|1 gen=0|1 init=0|1 (stage-3
from_pretrained of a saved tiny model before training) rows=<dataset size> (default: steps x 4 x acc
x ranks; with rows / (4 x ranks) micro-batches per rank not a multiple of acc, each epoch ends with
a short accumulation window)."""
import json
import logging
import os
import re
import sys

import torch

import transformers
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from ddp_teardown import end_reference_run  # (this folder: the script's own, first on sys.path)

VOCAB, SEQ = 96, 16


def opts():
    o = dict(backend="zerocore", stage="2", offload="0", steps="30", save_steps="0", resume="", trainer="trainer",
             lora="0", gen="0", init="0", acc="2", wd="0.0", best="0", rows="0", sched="", bf16="0", master="",
             gc="0", compile="", unit_min="", oom="0", bs="4", neftune="", eval_first="0", eval_only="0", reads="0")
    for a in sys.argv[2:]:
        k, v = a.split("=", 1)
        o[k] = v
    return o


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """Sequences with structure to learn (each token = previous + a per-sequence step, mod VOCAB)."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone(), "attention_mask": torch.ones(SEQ, dtype=torch.long)}


def zero_config(o):
    z = {"stage": int(o["stage"])}
    if o["offload"] == "1":
        z["offload_optimizer"] = {"device": "cpu"}
        if z["stage"] == 3:
            z["offload_param"] = {"device": "cpu"}
    if z["stage"] == 3:
        z["stage3_param_persistence_threshold"] = "auto"
        z["stage3_prefetch_bucket_size"] = "auto"
        # DeepSpeed gathers the 16-bit weights for save_model only with it (zerocore always does)
        z["stage3_gather_16bit_weights_on_model_save"] = True
        if o["unit_min"]:
            z["stage3_unit_min_params"] = int(o["unit_min"])
    z["reduce_bucket_size"] = "auto"
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": z}
    if o["bf16"] == "1":
        cfg["bf16"] = {"enabled": "auto"}
    if o["master"]:  # zerocore's data_types.master_init ("rounded": DeepSpeed's start of the fp32 master)
        cfg["data_types"] = {"master_init": o["master"]}
    if o["sched"]:  # DeepSpeed's own optimizer and schedule, every value from the TrainingArguments
        cfg["optimizer"] = {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}
        keys = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps") + (
            ("total_num_steps",) if o["sched"] == "WarmupDecayLR" else ())
        cfg["scheduler"] = {"type": o["sched"], "params": {k: "auto" for k in keys}}
    return cfg


def trainable_params_logged() -> list:
    """The counts of the Trainer's "Number of trainable parameters = N" line as training starts (what a user reads),
    appended as logged (the Trainer's info lines are not printed, its warnings are)."""
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            m = re.search(r"Number of trainable parameters = ([\d,]+)", record.getMessage())
            if m:
                seen.append(int(m.group(1).replace(",", "")))

    log = logging.getLogger("transformers.trainer")
    log.setLevel(logging.INFO)
    log.propagate = False  # its warnings still printed:
    shown = logging.StreamHandler(sys.stderr)
    shown.setLevel(logging.WARNING)
    log.addHandler(shown)
    log.addHandler(Catch())
    return seen


def main():
    out, o = sys.argv[1], opts()
    work = os.path.dirname(os.path.abspath(out))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    steps, acc = int(o["steps"]), int(o["acc"])
    args = TrainingArguments(
        output_dir=os.path.join(work, "run"), per_device_train_batch_size=int(o["bs"]), gradient_accumulation_steps=acc,
        max_steps=steps, learning_rate=3e-3, warmup_steps=5, lr_scheduler_type="linear", weight_decay=float(o["wd"]),
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if int(o["save_steps"]) else "no",
        save_steps=int(o["save_steps"]) or 500, use_cpu=True, ddp_backend="gloo", report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0, bf16=o["bf16"] == "1", gradient_checkpointing=o["gc"] == "1",
        auto_find_batch_size=o["oom"] == "1", neftune_noise_alpha=float(o["neftune"]) if o["neftune"] else None,
        **(dict(torch_compile=True, torch_compile_backend=o["compile"]) if o["compile"] else {}),
        **(dict(deepspeed=zero_config(o)) if o["backend"] == "deepspeed" else {}),
        **(dict(eval_strategy="steps", eval_steps=int(o["save_steps"]), load_best_model_at_end=True,
                metric_for_best_model="loss", greater_is_better=True, per_device_eval_batch_size=4)
           if o["best"] == "1" else {}))
    result = {}
    if o["init"] == "1":  # a model saved by plain from-config, loaded partitioned under stage 3
        import zerocore.integrations.transformers as zt

        src = os.path.join(work, "pretrained")
        if args.process_index == 0:
            tiny_model().save_pretrained(src)
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
        model = zt.from_pretrained(LlamaForCausalLM, src, zero_config(o))
        # parameters built partitioned by zerocore.init: this rank holds only its chunk of each
        result["partitioned_at_load"] = sum(hasattr(p, "_zc_init") for p in model.parameters())
    else:
        model = tiny_model()
    if o["lora"] == "1":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0))
    if o["oom"] == "1":
        calls = [0]

        def out_of_memory(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            calls[0] += 1
            if ids is not None and ids.shape[0] > 2 and calls[0] >= 2:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes "
                                   "(simulated)")

        model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    data = Tokens(int(o["rows"]) or steps * 4 * acc * world)
    kw = dict(model=model, args=args, train_dataset=data)
    if "1" in (o["best"], o["eval_first"], o["eval_only"]):  # a held-out set (best: its loss picks the checkpoint)
        kw["eval_dataset"] = torch.utils.data.Subset(Tokens(64), range(40, 64))
    if o["trainer"] == "sft":
        from trl import SFTConfig, SFTTrainer

        sargs = SFTConfig(**{k: v for k, v in args.to_dict().items() if k in SFTConfig.__dataclass_fields__
                             and SFTConfig.__dataclass_fields__[k].init and not k.startswith("_")})
        sargs.dataset_kwargs = {"skip_prepare_dataset": True}
        sargs.packing = False
        kw["args"] = sargs
        import datasets
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        # a word-level vocabulary built here: SFTTrainer pads with its tokenizer (nothing downloaded)
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            {f"t{i}": i for i in range(VOCAB)}, unk_token="t0")), pad_token="t0", eos_token="t1")
        kw["train_dataset"] = datasets.Dataset.from_dict({"input_ids": data.ids.tolist()})
        kw["processing_class"] = tok
        base = SFTTrainer
    else:
        base = transformers.Trainer
    if o["backend"] == "zerocore":
        from zerocore.integrations.transformers import make_zero_trainer

        trainer = make_zero_trainer(base)(**kw, zerocore_config=zero_config(o))
    else:
        trainer = base(**kw)
    if "1" in (o["eval_first"], o["eval_only"]):
        before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        result["first_eval_loss"] = trainer.evaluate()["eval_loss"]
        result["predictions_shape"] = list(trainer.predict(kw["eval_dataset"]).predictions.shape)
        early = getattr(trainer, "zerocore_eval_engine", None)
        if early is not None:  # the engine the evaluation ran on: trains nothing, holds the shards only
            rep = early.memory_report()
            result["eval_engine"] = {"trains": early.trains, "master": rep["master"], "moments":
                                     rep["exp_avg"] + rep["exp_avg_sq"], "grads": rep["grads"],
                                     "param_elems": sum(p.numel() for p in model.parameters())}
        if o["eval_only"] == "1":
            final = os.path.join(work, "final")
            trainer.save_model(final)
            if args.process_index == 0:
                back = LlamaForCausalLM.from_pretrained(final).state_dict()
                result["saved_max_diff"] = max((back[k].float() - before[k]).abs().max().item() for k in back)
                with open(out, "w") as f:
                    json.dump(result, f)
            if o["backend"] != "zerocore":
                end_reference_run()
            return
    counts = trainable_params_logged()
    trainer.train(resume_from_checkpoint=o["resume"] or None)
    result["trainable_params_logged"] = counts
    # what the optimizer steps (LoRA: the adapters only) is exactly what requires grad
    in_opt = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    if o["backend"] != "deepspeed":  # (DeepSpeed's groups hold its flat fp32 partitions)
        result["optimizer_is_trainable"] = in_opt == {id(p) for p in model.parameters() if p.requires_grad}
        result["optimizer_params"] = len(in_opt)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result["wrapped_as"] = type(trainer.model_wrapped).__name__  # what the Trainer trained through
    result["total_flos"] = trainer.state.total_flos  # (Transformers' estimate from the parameter count)
    result["eval_losses"] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    result["best_checkpoint"] = trainer.state.best_model_checkpoint
    result.update(losses=[h["loss"] for h in logs], lrs=[h["learning_rate"] for h in logs],
                  grad_norms=[h.get("grad_norm") for h in logs], steps=[h["step"] for h in logs])
    eng = getattr(trainer, "zerocore_engine", None)
    if o["compile"]:  # compiled as asked, and graphs were made
        from torch._dynamo.utils import counters

        result["compiled"] = bool(eng.is_compiled) if eng is not None else None
        result["unique_graphs"] = counters["stats"]["unique_graphs"]
    if o["backend"] == "deepspeed":  # the whole 16-bit (or fp32) weights, gathered on rank 0 only at stage 3
        whole = trainer.accelerator.get_state_dict(trainer.model_wrapped) or {}
        sd = {k: v.detach().float().clone() for k, v in whole.items()}
    elif eng is not None:
        sd = {k: v.float() for k, v in eng.full_state_dict().items()}
    else:
        sd = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    final = os.path.join(work, "final")
    trainer.save_model(final)
    if o["gen"] == "1":
        from zerocore.integrations.transformers import generate

        prompt = Tokens(2).ids[:1, :4]
        # ranks ask for different lengths: a rank that is done keeps joining the others' forwards
        n_new = 3 + 4 * args.process_index
        with torch.no_grad():
            ids = generate(model, input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new,
                           min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        result["generated"] = ids[0].tolist()
    if args.process_index == 0:
        files = sorted(os.listdir(final))
        result["saved_files"] = files
        if o["lora"] == "1":
            from safetensors.torch import load_file

            saved = load_file(os.path.join(final, "adapter_model.safetensors"))
            result["adapter_keys"] = sorted(saved)
            result["adapter_max_diff"] = max(
                (saved[k] - sd[next(n for n in sd if n.endswith(k.replace(".weight", ".default.weight")))]).abs().max().item()
                for k in saved)
        elif o["backend"] != "deepspeed":  # (DeepSpeed's stage 3 would load it under its zero.Init: a collective)
            back = LlamaForCausalLM.from_pretrained(final).state_dict()
            result["reload_max_diff"] = max((back[k] - sd[k]).abs().max().item() for k in back)
            result["reload_empty"] = [k for k, v in back.items() if v.numel() == 0]
        result["weights"] = {k: v.reshape(-1)[:64].tolist() for k, v in sd.items()}
        if READS is not None:
            result["partitioned_reads"] = [str(r) for r in READS.reads]
        with open(out, "w") as f:
            json.dump(result, f)
    if o["backend"] != "zerocore":
        end_reference_run()


READS = None  # reads=1: the zerocore.debug.partitioned_reads log of the whole run


if __name__ == "__main__":
    if "reads=1" in sys.argv[2:]:
        import zerocore.debug

        with zerocore.debug.partitioned_reads() as READS:
            main()
    else:
        main()
