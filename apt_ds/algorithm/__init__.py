"""APT itself, on plain PyTorch modules: no DeepSpeed, no files, no argument parsing.

units      the prunable units of a LLaMA model (KV groups, FFN neurons, hidden channels) and their counts
adapters   the APT adapter Linear: LoRA A/B with output-preserving rank growth and merge
masks      unit masks installed into attention, MLP, residual stream and RMSNorm
salience   outlier-aware salience from |activation x gradient|, kept as EMAs
schedule   cubic density schedule and pruning-event steps
pruner     which units to keep at an event (exact-budget search, uniform mode, gradual masks)
tuner      adapter importance and rank growth within a parameter budget
distill    self-distillation from the last event's snapshot
shrink     physically slicing masked modules (weights, adapters, norms, per-layer config)
finite     the NaN/inf checks every decision, checkpoint and export makes first
edits      records of shape changes, so a training backend can carry optimizer state along
state      APTModel: the model under APT (adapters, masks, salience, shapes), its shrink and rank
           growth, and its resumable state as JSON-ready records
"""
