#!/usr/bin/env bash
# 4D parallelism on one machine: pipeline 2 x FSDP 2 x context parallel 2 x tensor parallel 2 = 16 ranks.
# Interleaved 1F1B runs 4 stages of 2 blocks (2 per rank); each pipeline step splits the 4 sequences of its
# data-parallel rank into 4 micro-batches; the 256 tokens of a sequence are split over 2 CP ranks and the
# heads over 2 TP ranks. Extra arguments are Hydra overrides (e.g. training.steps=3).
# On a GPU node this starts 16 workers; on CPU (gloo) it runs too, slowly: ~1 min for a few steps on 2 cores.
set -euo pipefail
exec python -m titan_core.run '+plugins=[pp,fsdp,tp,cp]' \
  plugins.pp.degree=2 plugins.pp.schedule=Interleaved1F1B plugins.pp.microbatches=4 \
  plugins.fsdp.degree=2 plugins.cp.degree=2 plugins.tp.degree=2 \
  model=debug model.n_layers=8 tokenizer.path=bytes \
  training.seq_len=256 training.global_batch_size=8 training.steps=20 metrics.log_every=1 "$@"
