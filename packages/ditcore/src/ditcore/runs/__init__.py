"""The run directory and its checkpoints: the one place that names their files, writes them and reads them.

    RUN_DIR/
      .lock                        held by the training run that writes here (dit_train.rundir): one at a time
      checkpoints/step-XXXXXXX/    a complete training checkpoint (written as .tmp-step-XXXXXXX/, then renamed);
                                   step-XXXXXXX-2 (-3 …): another trajectory's checkpoint of the same step
        .metadata  __R_0.distcp    torch.distributed.checkpoint, one file per process R: model, EMA and AdamW
                                   state under their one-device names, each rank writing its own pieces (any
                                   layout resumes from it); step, loss history, learning-rate schedule   (tensors)
        loader-dpXXXXX.json        one per data-parallel rank: its data loader's position (older: .pkl, pickled)
        rng-XXXXX.pt               one per process: its RNG states
        config.yaml                the resolved training config                                      (step_files)
        model.json  ditcore.json   what the export records beside the weights (ditcore.export.describe): a
        codec_*                    checkpoint's EMA weights sample before the run is exported
        COMPLETE                   JSON manifest, written last: step, layout, lineage, {file: {bytes, crc32}}
                                                                                                       (manifest)
      export/                      consolidated EMA weights for sampling on one device (ditcore.export)
      samples/step-XXXXXXX/        validation samples
      csv/  tensorboard/  loss.png logs                                                                (folders)

dit-train decides when to save and what to resume (dit_train.checkpoint) and gives the tensors of a model of any
layout as layout-free views (ditcore.parallel.dist_checkpoint); everything about the files is here. dit-sample finds
the export and the checkpoints and loads a checkpoint's EMA weights, consolidated, on one device (weights), with no
process group and nothing from ditcore.parallel. Nothing in a checkpoint is read in a way that could run code:
tensors through safetensors or torch's weights-only unpickler, state as JSON, and DCP's index and older
checkpoints' pickles through restricted unpicklers (ditcore.safe_state).
"""

from ditcore.runs.folders import (
    CHECKPOINTS,
    CSV,
    EXPORT,
    HELDOUT_PLOT,
    LOCK_FILE,
    LOSS_PLOT,
    MARKER,
    OUTPUTS,
    SAMPLES,
    SHEET,
    TENSORBOARD,
    TMP_PREFIX,
    WANDB,
    CheckpointError,
    begin_step,
    complete_checkpoints,
    export_dir,
    find_export,
    find_sampleable,
    free_step_dir,
    is_complete,
    samples_dir,
    step_dir,
    step_of,
    tmp_dir,
)
from ditcore.runs.manifest import (
    by_write_order,
    lineage,
    new_run_id,
    newest,
    next_lineage,
    next_seq,
    parent_ref,
    publish,
    read_manifest,
    seal,
    trajectory,
    verify,
    write_manifest,
)
from ditcore.runs.step_files import (
    CONFIG_FILE,
    loader_file,
    read_config,
    read_loader_state,
    restore_rng,
    rng_file,
    write_config,
    write_loader_state,
    write_rng,
)
from ditcore.runs.tensors import (
    EMA,
    METADATA,
    MODEL,
    OPTIM,
    VALUES,
    SafeReader,
    checkpoint_error,
    checkpoint_tensors,
    files_of_rank,
    load_optimizer_hyperparameters,
    load_tensors,
    model_mismatch,
    optimizer_hyperparameters,
    read_full,
    read_values,
    save_tensors,
    stored_shapes,
)
from ditcore.runs.weights import load_weights

__all__ = [
    "CHECKPOINTS", "CONFIG_FILE", "CSV", "EMA", "EXPORT", "HELDOUT_PLOT", "LOCK_FILE", "LOSS_PLOT", "MARKER",
    "METADATA", "MODEL", "OPTIM", "OUTPUTS", "SAMPLES", "SHEET", "TENSORBOARD", "TMP_PREFIX", "VALUES", "WANDB",
    "CheckpointError", "SafeReader",
    "begin_step", "by_write_order", "checkpoint_error", "checkpoint_tensors", "complete_checkpoints", "export_dir",
    "files_of_rank", "find_export", "find_sampleable", "free_step_dir", "is_complete", "lineage",
    "load_optimizer_hyperparameters", "load_tensors", "load_weights", "loader_file", "model_mismatch", "new_run_id",
    "newest", "next_lineage", "next_seq", "optimizer_hyperparameters", "parent_ref", "publish", "read_config",
    "read_full", "read_loader_state", "read_manifest", "read_values", "restore_rng", "rng_file", "samples_dir",
    "save_tensors", "seal", "step_dir", "step_of", "stored_shapes", "tmp_dir", "trajectory", "verify", "write_config",
    "write_loader_state", "write_manifest", "write_rng",
]
