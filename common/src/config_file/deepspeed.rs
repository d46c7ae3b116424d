//! A DeepSpeed configuration (`ds_config.json`) read as our flags, key by key as DeepSpeed
//! documents them (`deepspeed/runtime/zero/config.py`, `precision_config.py`, `constants.py`):
//!
//! - mapped to a flag: `zero_optimization.stage` → `--zero`, `zero_optimization.reduce_bucket_size`
//!   (elements of 4 bytes) → `--bucket-mb`, `train_micro_batch_size_per_gpu` → `--batch-size`,
//!   `gradient_accumulation_steps` → `--accumulate`, `gradient_clipping` → `--clip`,
//!   `fp16.enabled` / `bf16.enabled` → `--precision 16-mixed` / `bf16-mixed`,
//!   `communication_data_type: "fp16"` → `--fp16-allreduce`, `optimizer` (Adam, SGD, LAMB: its
//!   `lr`, `weight_decay`, `momentum`) → `--optimizer`, `--lr`, `--weight-decay`, `--momentum`;
//! - accepted, and named in one line where its value asks for something this project does not
//!   do (with why): the rest of those sections' keys and DeepSpeed's other top-level keys. A key
//!   at what this project does anyway (or off, for a feature it lacks) is accepted without a
//!   word: of the IDRIS slide's `ds_config_zero2.json`, only `allgather_bucket_size` is named;
//! - an error naming it: a key DeepSpeed itself does not know, in a section it has.
//!
//! Other top-level keys are this project's own flags (checked by [`super::flags_of`]).
use serde_json::{Map, Value};

/// What a DeepSpeed table gives: flags (long name without dashes, value) and notes, one line each.
#[derive(Debug, Default)]
pub struct Translation {
    pub flags: Vec<(String, Value)>,
    pub notes: Vec<String>,
}

/// How a key DeepSpeed documents is taken here.
enum Key {
    /// Accepted silently at the values the test accepts (what this project does); at another
    /// value, named with this reason.
    Same(fn(&Value) -> bool, &'static str),
    /// A feature this project does not have: accepted silently when off (false, null, 0, a
    /// section whose `enabled` is false), named with this reason otherwise.
    Absent(&'static str),
}

const TRUE: fn(&Value) -> bool = |v| *v == Value::Bool(true);
const FALSE: fn(&Value) -> bool = |v| *v == Value::Bool(false);
/// No value: whatever is given asks for something not done here.
const NONE: fn(&Value) -> bool = |_| false;

/// `zero_optimization`'s keys besides `stage` and `reduce_bucket_size` (mapped).
fn zero_key(name: &str) -> Option<Key> {
    use Key::*;
    Some(match name {
        "contiguous_gradients" => Same(TRUE, "the gradients are always gathered into contiguous buckets here"),
        "overlap_comm" => Same(TRUE, "ZeRO-2's buckets always communicate during the backward pass here"),
        "reduce_scatter" => Same(TRUE, "ZeRO 1 and 2 always reduce-scatter the gradients here"),
        "allgather_partitions" => Same(TRUE, "the updated parameters are always all-gathered here"),
        "allgather_bucket_size" => Same(NONE, "ZeRO 1 and 2 all-gather the updated parameters in one collective per step here, ZeRO-3 layer by layer"),
        "use_multi_rank_bucket_allreduce" => Same(TRUE, "each bucket is reduced once for all ranks here"),
        "load_from_fp32_weights" => Same(TRUE, "checkpoints always hold and restore the float32 weights"),
        "ignore_unused_parameters" => Same(TRUE, "parameters without a gradient are left out of the buckets here"),
        "memory_efficient_linear" => Same(TRUE, "ZeRO-3 here frees each layer's gathered weights after use"),
        "override_module_apply" => Same(TRUE, "ZeRO-3's hooks are this project's own"),
        "round_robin_gradients" => Absent("no CPU offloading here"),
        "offload_param" => Absent("no offloading here: the parameters stay on the GPU"),
        "offload_optimizer" => Absent("no offloading here: the optimizer's state stays on the GPU"),
        "cpu_offload" | "cpu_offload_param" | "cpu_offload_use_pin_memory" => Absent("no offloading here (and DeepSpeed deprecates this key)"),
        "sub_group_size" => Same(NONE, "the optimizer steps over whole shards here"),
        "elastic_checkpoint" => Absent("every checkpoint here resumes on any layout"),
        "legacy_stage1" => Absent("one ZeRO-1 here"),
        "zero_hpz_partition_size" => Same(NONE, "no secondary partition (ZeRO++ hpZ) here; --shard-group shards within groups (HSDP)"),
        "zero_quantized_weights" | "zero_quantized_nontrainable_weights" | "zero_quantized_gradients" => Absent("no quantized communication here"),
        "zeropp_loco_param" => Absent("no quantized communication here"),
        "mics_shard_size" => Same(NONE, "no MiCS here; --shard-group shards within groups (HSDP)"),
        "mics_hierarchical_params_gather" => Absent("no MiCS here"),
        "pipeline_loading_checkpoint" => Absent("checkpoints load the same way with or without pipelines here"),
        "log_trace_cache_warnings" | "enable_sanity_checks" => Absent("DeepSpeed's own diagnostics"),
        "zenflow" | "leaf_module" | "save_muon_momentum_buffer_in_memory" => Absent("not part of this project's ZeRO"),
        "stage3_prefetch_bucket_size" | "prefetch_bucket_size" => Same(NONE, "ZeRO-3 gathers each layer when it is needed, one at a time"),
        "stage3_param_persistence_threshold" | "param_persistence_threshold" | "stage3_model_persistence_threshold" | "model_persistence_threshold" => {
            Same(NONE, "ZeRO-3 shards every parameter here, small ones too")
        }
        "stage3_max_live_parameters" | "max_live_parameters" | "stage3_max_reuse_distance" | "max_reuse_distance" => {
            Same(NONE, "ZeRO-3 frees each layer's gathered weights after its pass here")
        }
        "stage3_gather_16bit_weights_on_model_save" | "gather_16bit_weights_on_model_save" | "stage3_gather_fp16_weights_on_model_save" => {
            Absent("checkpoints hold the float32 weights, gathered or sharded (--checkpoint-format)")
        }
        "stage3_module_granularity_threshold" | "module_granularity_threshold" => Same(NONE, "ZeRO-3 gathers per layer here"),
        "stage3_use_all_reduce_for_fetch_params" | "use_all_reduce_for_fetch_params" | "stage3_allgather_sequential" | "allgather_sequential" => {
            Absent("ZeRO-3 all-gathers each layer's parameters together here")
        }
        "stage3_partition_stream_chunk_size" | "partition_stream_chunk_size" => Absent("parameters are partitioned whole here"),
        _ => return None,
    })
}

/// `fp16`'s keys besides `enabled` (mapped). The scaler here is torch's `GradScaler`: dynamic,
/// from 2^16, halved on an inf/NaN step, doubled after 2,000 clean ones.
fn fp16_key(name: &str) -> Option<Key> {
    use Key::*;
    Some(match name {
        "auto_cast" => Same(FALSE, "16-mixed autocasts the forward pass here; the inputs stay as they are"),
        "loss_scale" => Same(|v| v.as_f64() == Some(0.0), "the loss scale is always dynamic here (0)"),
        "initial_scale_power" => Same(|v| v.as_f64() == Some(16.0), "the scaler starts at 2^16 here"),
        "loss_scale_window" => Same(|v| v.as_f64() == Some(2000.0), "the scale doubles after 2,000 clean steps here (torch's GradScaler)"),
        "hysteresis" | "consecutive_hysteresis" => Same(NONE, "the scale halves at once on an inf/NaN step here (torch's GradScaler)"),
        "min_loss_scale" => Same(NONE, "the scale has no floor here (torch's GradScaler)"),
        "fused_mode" => Same(TRUE, "the unscaling is fused with the optimizer's check here"),
        "fp16_master_weights_and_grads" => Same(FALSE, "the master weights and gradients stay float32 here"),
        _ => return None,
    })
}

/// `bf16`'s keys besides `enabled` (mapped).
fn bf16_key(name: &str) -> Option<Key> {
    use Key::*;
    Some(match name {
        "immediate_grad_update" => Same(NONE, "the gradients update the weights at the step, once accumulated"),
        "check_grad_overflow" => Absent("bf16 needs no overflow check here (float32's range)"),
        "bf16_master_weights_and_grads" | "bf16_optimizer_states" => Same(FALSE, "the master weights, gradients and optimizer state stay float32 here"),
        _ => return None,
    })
}

/// DeepSpeed's top-level keys that are neither mapped nor one of its sections handled above.
fn top_key(name: &str) -> Option<Key> {
    use Key::*;
    Some(match name {
        "train_batch_size" => Same(NONE, "the global batch here is --batch-size × --accumulate × the data-parallel ranks"),
        "scheduler" => Absent("the schedule is --lr-schedule and --warmup-steps here"),
        "prescale_gradients" => Same(FALSE, "gradients are averaged after they are summed here"),
        "gradient_predivide_factor" => Same(NONE, "gradients are averaged after they are summed here"),
        "zero_allow_untested_optimizer" | "zero_force_ds_cpu_optimizer" => Same(NONE, "every optimizer here works with ZeRO"),
        "sparse_gradients" => Absent("no sparse gradients here"),
        "amp" => Absent("no Apex AMP here: --precision 16-mixed is torch.amp's"),
        "steps_per_print" => Same(NONE, "--course-log N prints every N steps here"),
        "wall_clock_breakdown" | "memory_breakdown" => Absent("the results JSON always holds the step's split and each rank's peak memory"),
        "dump_state" => Absent("--print-config prints the resolved flags here"),
        "seq_parallel_communication_data_type" => Same(NONE, "sequence parallelism communicates in the activations' precision here"),
        "disable_allgather" => Absent("ZeRO's all-gathers are needed here"),
        "graph_harvesting" => Absent("--cuda-graph records the whole step here"),
        "vocabulary_size" => Same(NONE, "the vocabulary comes from the data here (--pad-vocab pads it)"),
        "eigenvalue" | "progressive_layer_drop" | "curriculum_learning" | "data_efficiency" | "compression_training" | "weight_quantization" => {
            Absent("not part of this project")
        }
        "sparse_attention" => Absent("no sparse attention here"),
        "flops_profiler" => Absent("every run reports its TFLOP/s and MFU; --profile profiles"),
        "activation_checkpointing" => Absent("--checkpoint-activations recomputes the pipeline's stages here"),
        "tensorboard" | "wandb" | "csv_monitor" | "comet" => Absent("--tensorboard DIR writes TensorBoard files; results/ holds the CSV and JSON"),
        "comms_logger" | "timers" => Absent("the results JSON holds each collective's calls and bytes"),
        "elasticity" => Absent("a checkpoint resumes on another world size here, no elastic batch"),
        "pipeline" => Absent("exercise3 pipeline's flags set the pipeline here"),
        "checkpoint" => Absent("--checkpoint-dir and --checkpoint-format set checkpoints here"),
        "data_types" => Absent("gradients accumulate in float32 here"),
        "dataloader_drop_last" => Absent("the loaders keep the last batch here"),
        "aio" | "nebula" => Absent("checkpoints are written by this project's own writer"),
        "autotuning" => Absent("exercise3 plan ranks layouts from a profile here"),
        "hybrid_engine" | "torch_autocast" | "compile" | "tensor_parallel" | "quantize_training" | "use_data_before_expert_parallelism" => {
            Absent("not part of this project's DeepSpeed reading")
        }
        "bfloat16" => Absent("DeepSpeed's old name for the bf16 section: write bf16"),
        _ => return None,
    })
}

/// Whether `value` leaves a feature off: false, null, 0, an empty section, or one whose
/// `enabled` is false.
fn off(value: &Value) -> bool {
    match value {
        Value::Bool(b) => !b,
        Value::Null => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Object(m) => m.is_empty() || m.get("enabled") == Some(&Value::Bool(false)),
        _ => false,
    }
}

/// The note for `key` (as `path`) at `value`, if it asks for something not done here.
fn judge(path: &str, key: Key, value: &Value) -> Option<String> {
    let (silent, why) = match key {
        Key::Same(accepts, why) => (accepts(value), why),
        Key::Absent(why) => (off(value), why),
    };
    (!silent).then(|| format!("DeepSpeed's `{path}` = {value} has no effect here: {why}"))
}

/// The flags and notes of a DeepSpeed table (every top-level key: DeepSpeed's, or one of ours).
pub fn translate(table: Map<String, Value>) -> Result<Translation, String> {
    let mut out = Translation::default();
    for (key, value) in table {
        match (key.as_str(), value) {
            ("zero_optimization", Value::Object(zero)) => section(&mut out, "zero_optimization", zero, zero_key)?,
            ("fp16", Value::Object(fp16)) => section(&mut out, "fp16", fp16, fp16_key)?,
            ("bf16", Value::Object(bf16)) => section(&mut out, "bf16", bf16, bf16_key)?,
            ("train_micro_batch_size_per_gpu", v) => out.flags.push(("batch-size".into(), v)),
            ("gradient_accumulation_steps", v) => out.flags.push(("accumulate".into(), v)),
            ("gradient_clipping", v) => out.flags.push(("clip".into(), v)),
            ("communication_data_type", Value::String(kind)) => match kind.to_lowercase().as_str() {
                "fp16" => out.flags.push(("fp16-allreduce".into(), Value::Bool(true))),
                "fp32" | "none" => {}
                other => out.notes.push(format!("DeepSpeed's `communication_data_type` = \"{other}\" has no effect here: gradients travel as float32 or, with --fp16-allreduce, float16")),
            },
            ("optimizer", Value::Object(optimizer)) => optimizer_section(&mut out, optimizer)?,
            (name, value) if top_key(name).is_some() && (value.is_object() || !is_ours(name)) => {
                out.notes.extend(judge(name, top_key(name).expect("matched"), &value));
            }
            (_, Value::Object(_)) => {
                return Err(format!(
                    "unknown section `{key}`: DeepSpeed has no such section, and flags are keys of the top level (DeepSpeed's zero_optimization, fp16, bf16, optimizer and its other sections are read)"
                ))
            }
            (_, v) => out.flags.push((key, v)),
        }
    }
    Ok(out)
}

/// Top-level DeepSpeed names that are also this project's flags with a value of their own
/// (`--checkpoint FILE`, `--tensorboard DIR`): a scalar there is the flag.
fn is_ours(name: &str) -> bool {
    matches!(name, "checkpoint" | "tensorboard")
}

fn section(out: &mut Translation, name: &str, keys: Map<String, Value>, known: fn(&str) -> Option<Key>) -> Result<(), String> {
    for (k, v) in keys {
        let path = format!("{name}.{k}");
        match (name, k.as_str()) {
            ("zero_optimization", "stage") => out.flags.push(("zero".into(), v)),
            ("zero_optimization", "reduce_bucket_size") => {
                let Some(elements) = v.as_f64() else { return Err(format!("key `{path}`: a number of elements, not {v}")) };
                out.flags.push(("bucket-mb".into(), serde_json::json!(elements * 4.0 / (1024.0 * 1024.0))));
            }
            ("fp16" | "bf16", "enabled") => {
                if v == Value::Bool(true) {
                    out.flags.push(("precision".into(), Value::String(if name == "fp16" { "16-mixed" } else { "bf16-mixed" }.into())));
                }
            }
            _ => match known(&k) {
                Some(key) => out.notes.extend(judge(&path, key, &v)),
                None => return Err(format!("unknown key `{path}`: DeepSpeed has no such key in its `{name}` section")),
            },
        }
    }
    Ok(())
}

/// DeepSpeed's `optimizer` section: {type, params}. Adam, SGD and LAMB map to ours (torch's
/// Adam, SGD; LAMB's layer-wise trust ratio), with their rate, weight decay and momentum;
/// another type, or a parameter ours lacks, is named.
fn optimizer_section(out: &mut Translation, section: Map<String, Value>) -> Result<(), String> {
    let kind = match section.get("type") {
        Some(Value::String(t)) => t.to_lowercase(),
        other => return Err(format!("key `optimizer.type`: the optimizer's name (Adam, SGD, ...), not {}", other.unwrap_or(&Value::Null))),
    };
    let ours = match kind.as_str() {
        "adam" => Some("adam"),
        "sgd" => Some("sgd"),
        "lamb" => Some("lamb"),
        _ => None,
    };
    let Some(ours) = ours else {
        out.notes.push(format!("DeepSpeed's `optimizer.type` = \"{kind}\" has no effect here: --optimizer trains with adam, sgd, lars or lamb"));
        return Ok(());
    };
    out.flags.push(("optimizer".into(), Value::String(ours.into())));
    for (k, v) in section {
        match k.as_str() {
            "type" => {}
            "params" => {
                let Value::Object(params) = v else { return Err(format!("key `optimizer.params`: a table, not {v}")) };
                for (p, value) in params {
                    match p.as_str() {
                        "lr" => out.flags.push(("lr".into(), value)),
                        "weight_decay" => out.flags.push(("weight-decay".into(), value)),
                        "momentum" if ours == "sgd" => out.flags.push(("momentum".into(), value)),
                        "betas" if value == serde_json::json!([0.9, 0.999]) => {}
                        "eps" if value.as_f64() == Some(1e-8) => {}
                        "torch_adam" | "adam_w_mode" | "fused" if value == Value::Bool(false) => {}
                        _ => out.notes.push(format!(
                            "DeepSpeed's `optimizer.params.{p}` = {value} has no effect here: {ours} takes its rate, weight decay{}",
                            if ours == "sgd" { " and momentum" } else { "" }
                        )),
                    }
                }
            }
            "legacy_fusion" => {}
            _ => return Err(format!("unknown key `optimizer.{k}`: DeepSpeed's optimizer section has type and params")),
        }
    }
    Ok(())
}
