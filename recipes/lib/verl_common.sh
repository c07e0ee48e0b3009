# Shared body of the verl recipes recipes/<model>_<dataset>.sh (sourced, not run).
#
# A recipe sets, then sources this file, then calls `jetrl_verl_run "$@"`:
#   MODEL_NAME   folder under recipes/models/ (its config.json holds the architecture facts: without
#                weights, DRY_RUN=1 MODEL_PATH=recipes/models/$MODEL_NAME checks the shapes)
#   MODEL_ID     HF id of the checkpoint (MODEL_PATH defaults to it)
#   DATASET      folder under $DATA_DIR written by scripts/data/$DATASET.py
#   ALGO         grpo | dapo (below)
#   and optionally RESPONSE_LEN / PROMPT_LEN / TOTAL_EPOCHS defaults of its own.
#
# Environment (defaults in brackets; every one can be set on the command line, e.g. NGPUS=4 bash ...):
#   MODEL_PATH [$MODEL_ID]  DATA_DIR [~/data/jetrl]  NGPUS [8]  NNODES [1]  ROLLOUT_TP [2]
#   RESPONSE_LEN [recipe's]  PROMPT_LEN [recipe's]  RECIPE [jetrl-unified | naive-fp8-rollout | bf16]
#   ENGINE_OPS [auto = hf for jetrl-unified, vllm for the baselines; hf = the rollout engine runs the actor's
#              norms, RoPE and SiLU (jetrl-unified only); fused = hf through jetrl's fused producer kernels,
#              the actor fusing its own too; vllm = vLLM's own ops]
#   NUMERICS [hf | strict = the actor's attention and log-probs through vLLM's kernels, both sides batch-invariant
#            (CUDA, jetrl-unified with ENGINE_OPS auto/hf; jetrl.numerics)]
#   REMOVE_PADDING [True; False with NUMERICS=strict, which needs verl's padded batch]
#   DRY_RUN [0; 1 = compose + validate + print the verl config, exit without Ray or GPU]
#   PYTHON [python]  LOGGER ['["console"]']  TOTAL_EPOCHS  TEST_FREQ [5]  SAVE_FREQ [-1]
# Extra hydra overrides after the script name are forwarded last ("$@"), so they win.
#
# Hyper-parameters. The Jet-RL paper (arXiv 2601.14243) fixes the models, the datasets and the 8K / 16K
# rollout lengths; its optimizer and batch settings were not available to us, so everything else
# follows verl's own examples, each group saying which:
#   grpo: verl examples/grpo_trainer/run_qwen2-7b.sh (GSM8K): batch 1024 prompts, mini-batch 256,
#         n=5, lr 1e-6, KL loss 0.001 (low_var_kl), no entropy bonus, 15 epochs.
#   dapo: verl recipe/dapo (run_dapo_qwen2.5_32b.sh, DAPO on math): batch 512 prompts drawn from
#         generation batches of 1536 with group filtering on acc (<= 10 rounds), mini-batch 32, n=16,
#         clip-higher 0.2 / 0.28, clip_ratio_c 10, token-mean loss, no KL, lr 1e-6 with 10 warm-up
#         steps, weight decay 0.1, overlong buffer 4096 tokens with penalty 1.0 (verl's dapo reward
#         manager: DAPO's overlong penalty stays there, not in jetrl/tasks/reward.py), val top_p 0.7.
# Token budgets (use_dynamic_bsz): actor 2x and log-prob passes 3x (prompt + response) per GPU, vLLM
# batches (prompt + response) tokens -- verl's DAPO examples' ratios.

: "${MODEL_NAME:?recipe must set MODEL_NAME}" "${MODEL_ID:?recipe must set MODEL_ID}"
: "${DATASET:?recipe must set DATASET}" "${ALGO:?recipe must set ALGO (grpo or dapo)}"

JETRL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MODEL_PATH=${MODEL_PATH:-$MODEL_ID}
DATA_DIR=${DATA_DIR:-$HOME/data/jetrl}
NGPUS=${NGPUS:-8}
NNODES=${NNODES:-1}
ROLLOUT_TP=${ROLLOUT_TP:-2}
RESPONSE_LEN=${RESPONSE_LEN:-8192}
PROMPT_LEN=${PROMPT_LEN:-1024}
RECIPE=${RECIPE:-jetrl-unified}
ENGINE_OPS=${ENGINE_OPS:-auto}
NUMERICS=${NUMERICS:-hf}
if [[ "$NUMERICS" == strict ]]; then REMOVE_PADDING=${REMOVE_PADDING:-False}; else REMOVE_PADDING=${REMOVE_PADDING:-True}; fi
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python}
LOGGER=${LOGGER:-'["console"]'}
TEST_FREQ=${TEST_FREQ:-5}
SAVE_FREQ=${SAVE_FREQ:--1}
EXPERIMENT=${EXPERIMENT:-${MODEL_NAME}_${DATASET}_${RECIPE}_r${RESPONSE_LEN}}

case "$RECIPE" in
  jetrl-unified | naive-fp8-rollout | bf16) ;;
  *) echo "RECIPE=$RECIPE: choose jetrl-unified, naive-fp8-rollout or bf16" >&2; exit 2 ;;
esac
case "$DRY_RUN" in
  0) DRY_RUN_FLAG=false ;;
  1) DRY_RUN_FLAG=true ;;
  *) echo "DRY_RUN=$DRY_RUN: use 0 or 1" >&2; exit 2 ;;
esac

SEQ_LEN=$((PROMPT_LEN + RESPONSE_LEN))

case "$ALGO" in
  grpo)
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-15}
    TRAIN_BATCH=${TRAIN_BATCH:-1024}
    GEN_BATCH=${GEN_BATCH:-$TRAIN_BATCH}
    MINI_BATCH=${MINI_BATCH:-256}
    N_RESP=${N_RESP:-5}
    ALGO_ARGS=(
      algorithm.adv_estimator=grpo
      algorithm.use_kl_in_reward=False
    )
    ACTOR_ALGO=(
      actor_rollout_ref.actor.use_kl_loss=True
      actor_rollout_ref.actor.kl_loss_coef=0.001
      actor_rollout_ref.actor.kl_loss_type=low_var_kl
      actor_rollout_ref.actor.entropy_coeff=0
    )
    REWARD_ALGO=(reward.reward_manager.name=naive)
    VAL_SAMPLING=(actor_rollout_ref.rollout.val_kwargs.do_sample=False)
    ;;
  dapo)
    TOTAL_EPOCHS=${TOTAL_EPOCHS:-10}
    TRAIN_BATCH=${TRAIN_BATCH:-512}
    GEN_BATCH=${GEN_BATCH:-$((TRAIN_BATCH * 3))}
    MINI_BATCH=${MINI_BATCH:-32}
    N_RESP=${N_RESP:-16}
    OVERLONG_BUFFER=${OVERLONG_BUFFER:-4096}
    ALGO_ARGS=(
      algorithm.adv_estimator=grpo
      algorithm.use_kl_in_reward=False
      algorithm.kl_ctrl.kl_coef=0.0
      algorithm.filter_groups.enable=True
      algorithm.filter_groups.metric=acc
      algorithm.filter_groups.max_num_gen_batches=10
    )
    ACTOR_ALGO=(
      actor_rollout_ref.actor.use_kl_loss=False
      actor_rollout_ref.actor.kl_loss_coef=0.0
      actor_rollout_ref.actor.entropy_coeff=0
      actor_rollout_ref.actor.clip_ratio_low=0.2
      actor_rollout_ref.actor.clip_ratio_high=0.28
      actor_rollout_ref.actor.clip_ratio_c=10.0
      actor_rollout_ref.actor.optim.lr_warmup_steps=10
      actor_rollout_ref.actor.optim.weight_decay=0.1
    )
    # verl's dapo reward manager reads reward.reward_kwargs, which verl's schema does not declare: added with '+'
    REWARD_ALGO=(
      reward.reward_manager.name=dapo
      +reward.reward_kwargs.max_resp_len="$RESPONSE_LEN"
      +reward.reward_kwargs.overlong_buffer_cfg.enable=True
      +reward.reward_kwargs.overlong_buffer_cfg.len="$OVERLONG_BUFFER"
      +reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
      +reward.reward_kwargs.overlong_buffer_cfg.log=False
    )
    VAL_SAMPLING=(
      actor_rollout_ref.rollout.val_kwargs.do_sample=True
      actor_rollout_ref.rollout.val_kwargs.temperature=1.0
      actor_rollout_ref.rollout.val_kwargs.top_p=0.7
    )
    ;;
  *) echo "ALGO=$ALGO: choose grpo or dapo" >&2; exit 2 ;;
esac

DATA=(
  data.train_files="$DATA_DIR/$DATASET/train.parquet"
  data.val_files="$DATA_DIR/$DATASET/test.parquet"
  data.prompt_key=prompt
  data.max_prompt_length="$PROMPT_LEN"
  data.max_response_length="$RESPONSE_LEN"
  data.train_batch_size="$TRAIN_BATCH"
  data.gen_batch_size="$GEN_BATCH"
  data.filter_overlong_prompts=True
  data.truncation=error
)

MODEL=(
  actor_rollout_ref.model.path="$MODEL_PATH"
  actor_rollout_ref.model.use_remove_padding="$REMOVE_PADDING"
  actor_rollout_ref.model.enable_gradient_checkpointing=True
)

ACTOR=(
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH"
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$((SEQ_LEN * 2))
  actor_rollout_ref.actor.loss_agg_mode=token-mean
  actor_rollout_ref.actor.grad_clip=1.0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
  actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=$((SEQ_LEN * 3))
  "${ACTOR_ALGO[@]}"
)

ROLLOUT=(
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.n="$N_RESP"
  actor_rollout_ref.rollout.tensor_model_parallel_size="$ROLLOUT_TP"
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.top_p=1.0
  actor_rollout_ref.rollout.top_k=-1
  actor_rollout_ref.rollout.max_num_batched_tokens="$SEQ_LEN"
  actor_rollout_ref.rollout.enable_chunked_prefill=True
  actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
  actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=$((SEQ_LEN * 3))
  actor_rollout_ref.rollout.val_kwargs.n=1
  "${VAL_SAMPLING[@]}"
)

REWARD=(
  reward.custom_reward_function.path="$JETRL_ROOT/jetrl/tasks/reward.py"
  reward.custom_reward_function.name=compute_score
  "${REWARD_ALGO[@]}"
)

TRAINER=(
  trainer.n_gpus_per_node="$NGPUS"
  trainer.nnodes="$NNODES"
  trainer.project_name=jetrl
  trainer.experiment_name="$EXPERIMENT"
  trainer.logger="$LOGGER"
  trainer.total_epochs="$TOTAL_EPOCHS"
  trainer.test_freq="$TEST_FREQ"
  trainer.save_freq="$SAVE_FREQ"
  trainer.val_before_train=True
)

JETRL=(
  jetrl.recipe="$RECIPE"
  jetrl.engine_ops="$ENGINE_OPS"
  jetrl.numerics="$NUMERICS"
  jetrl.dry_run="$DRY_RUN_FLAG"
)

jetrl_verl_run() {
  exec "$PYTHON" -m jetrl.verl \
    "${DATA[@]}" "${MODEL[@]}" "${ACTOR[@]}" "${ROLLOUT[@]}" "${ALGO_ARGS[@]}" "${REWARD[@]}" \
    "${TRAINER[@]}" "${JETRL[@]}" "$@"
}
