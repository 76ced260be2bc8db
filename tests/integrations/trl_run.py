"""TRL's trainers that need more than a loss on CPU ranks (torchrun, gloo), with zerocore
(``make_zero_trainer(Trainer)``) or plain DDP (``use_cpu=True``): a 2-layer Llama from its config, a word-level
tokenizer built here (nothing downloaded), prompts of 4 tokens.

- ``trainer=grpo``: GRPOTrainer, 4 sampled completions of up to 6 tokens per prompt scored by a reward that counts
  two tokens and the length, 3 steps: each step generates with the model being trained (``model.generate`` on every
  rank), scores, and takes a policy-gradient step.
- ``trainer=dpo``: DPOTrainer with a reference model (a copy of the model; with zerocore at stage 3 partitioned
  over the ranks, as TRL's DeepSpeed path does) and chosen / rejected completions, 4 steps.
- ``trainer=distill``: DistillationTrainer, a teacher (the model with noise added) and on-policy completions, 3 steps.
- ``trainer=gkd``: TRL's GKDTrainer, the same teacher, the dataset's completions (``seq_kd=1``: the teacher's own,
  generated every step), 3 steps.
- ``reward=model`` (GRPO): a reward model (a 1-layer Llama scoring head) beside the reward function.
- ``beta=0.04`` (GRPO): a KL term against a reference model (TRL loads it from the name in the policy's config:
  the policy's initial weights, saved here first).

Writes (rank 0) the logged losses (and GRPO's rewards, DPO's reward margins), the final weights, and what rank 0
holds of the reference model (``ref``: bytes of the whole model, bytes its zerocore engines hold, the elements its
parameters have outside a forward) as JSON.

    torchrun --nproc_per_node 2 trl_run.py OUT trainer=grpo backend=zerocore stage=3

``backend=both`` (one rank): the plain run, then zerocore's, in one process (one launch's imports, not two),
written as ``{"plain": ..., "zerocore": ...}``.
"""
import json
import os
import sys

import torch

from ddp_teardown import end_reference_run  # (this folder: the script's own, first on sys.path)

VOCAB = 32


def options(argv: list[str]) -> dict:
    o = {"backend": "zerocore", "stage": "3", "trainer": "grpo"}
    o.update(a.split("=", 1) for a in argv)
    return o


def main() -> None:
    out, o = sys.argv[1], options(sys.argv[2:])
    if o["backend"] == "both":
        res = {b: train(out, dict(o, backend=b)) for b in ("ddp", "zerocore")}
        res = {"plain": res["ddp"], "zerocore": res["zerocore"]}
    else:
        res = train(out, o)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    if o["backend"] == "ddp":
        end_reference_run()  # (zerocore's engine tears its group down itself)


def train(out: str, o: dict) -> dict:
    import copy

    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=2))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", bos_token="t2")
    n = 32
    prompts = [" ".join(f"t{(i + j) % 20 + 3}" for j in range(4)) for i in range(n)]
    common = dict(output_dir=os.path.join(os.path.dirname(out), "run"), per_device_train_batch_size=4,
                  logging_steps=1, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", bf16=False,
                  seed=0, ddp_backend="gloo")
    if o["trainer"] == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        def reward(completions, **kw):
            return [float(c.count("t5") + c.count("t7")) + 0.1 * len(c.split()) for c in completions]

        if float(o.get("beta", 0.0)) > 0:  # TRL builds the reference model from the name in the policy's config
            rank = os.environ.get("RANK", "0")
            saved = os.path.join(os.path.dirname(out), f"policy_{o['backend']}_rank{rank}")
            model.save_pretrained(saved)
            model.config._name_or_path = saved
        base, logged = GRPOTrainer, ("reward", "reward_std")
        rewards, processing = reward, None
        if o.get("reward") == "model":  # a reward model beside the function (TRL calls it under inference_mode)
            from transformers import LlamaForSequenceClassification

            torch.manual_seed(1)
            scorer = LlamaForSequenceClassification(LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                num_labels=1))
            rewards, processing = [reward, scorer], [None, tok]
        kw = dict(reward_funcs=rewards, reward_processing_classes=processing,
                  train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                  args=GRPOConfig(num_generations=4, max_completion_length=6, max_steps=3,
                                  beta=float(o.get("beta", 0.0)), **common))  # beta > 0: a KL term, a reference model
    elif o["trainer"] == "distill":
        from trl import DistillationConfig, DistillationTrainer

        teacher = copy.deepcopy(model)
        with torch.no_grad():  # a teacher that differs from the student
            for p in teacher.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        base, logged = DistillationTrainer, ()
        kw = dict(teacher_model=teacher, train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
                  args=DistillationConfig(max_completion_length=6, max_steps=3, **common))
    elif o["trainer"] == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        teacher = copy.deepcopy(model)
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
                             "{% if add_generation_prompt %} {% endif %}")
        chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": " ".join(
            f"t{(i * 5 + j) % 20 + 3}" for j in range(3))}] for i, p in enumerate(prompts)]
        base, logged = GKDTrainer, ()
        # lmbda 0: the dataset's completions; seq_kd: the teacher generates them (the teacher's generate at stage 3)
        kw = dict(teacher_model=teacher, train_dataset=datasets.Dataset.from_dict({"messages": chats}),
                  args=GKDConfig(max_new_tokens=4, max_steps=3, lmbda=0.0, seq_kd=o.get("seq_kd") == "1",
                                 temperature=1.0, max_length=24, **common))
    else:
        from trl import DPOConfig, DPOTrainer

        pairs = {"prompt": prompts,
                 "chosen": [" ".join(f"t{(i * 3 + j) % 20 + 3}" for j in range(3)) for i in range(n)],
                 "rejected": [" ".join(f"t{(i * 7 + j) % 20 + 3}" for j in range(5)) for i in range(n)]}
        base, logged = DPOTrainer, ("rewards/margins",)
        kw = dict(ref_model=copy.deepcopy(model), train_dataset=datasets.Dataset.from_dict(pairs),
                  args=DPOConfig(max_steps=4, **common))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # (before a stage-3 engine takes it)
    head_elems = model.lm_head.weight.numel()
    kw.update(model=model, processing_class=tok)
    if o["backend"] == "zerocore":
        from zerocore.integrations.transformers import make_zero_trainer

        trainer = make_zero_trainer(base)(**kw, zerocore_config={"zero_optimization": {
            "stage": int(o["stage"]), "stage3_param_persistence_threshold": 0}})
    else:
        trainer = base(**kw)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    eng = getattr(trainer, "zerocore_engine", None)
    sd = eng.full_state_dict() if eng is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
    # what this rank holds of the reference model: partitioned by zerocore at stage 3, whole otherwise
    ref = getattr(trainer, "ref_model", None) or getattr(trainer, "teacher_model", None)
    held = None
    if ref is not None:
        frozen = getattr(trainer, "zerocore_frozen_engines", [])
        held = {"whole": whole,
                "engines": len(frozen), "held": sum(e.memory_report()["frozen"] for e in frozen),
                "param_elems": sum(p.numel() for p in ref.parameters()),
                "head_elems": head_elems if getattr(trainer, "teacher_model", None) is not None else 0}
    frozen_engines = len(getattr(trainer, "zerocore_frozen_engines", []))
    if eng is not None:
        eng.destroy()
    return {"frozen_engines": frozen_engines, "losses": [h["loss"] for h in logs], **{k: [h[k] for h in logs] for k in logged},
            "weights": {k: v.float().reshape(-1).tolist() for k, v in sd.items()}, "ref": held}


if __name__ == "__main__":
    main()
