#!/usr/bin/env bash
# Pretrain a Llama-style model (RoPE, SwiGLU, RMSNorm, untied embeddings): run_gpt.sh with
# MODEL_FAMILY=llama. Same variables and pass-through, e.g. MODEL_SIZE=1.3b bash pretrain_scripts/run_llama.sh
MODEL_FAMILY=${MODEL_FAMILY:-llama} exec bash "$(dirname "$0")/run_gpt.sh" "$@"
