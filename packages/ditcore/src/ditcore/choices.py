"""The names of the library's choices that the apps offer, in a module that imports nothing: each list's one home,
read by the code that implements the choices and by the CLIs, whose --help lists them without importing torch.
A new solver, feature network, objective or codec is named here and implemented where its list is checked."""

SOLVERS = ("heun", "euler")  # ditcore.diffusion.sampler.edm_sampler: Algorithm 2's second-order step, or its Euler part
# what a sample is drawn with: SOLVERS, and for flow networks diffusers' UniPC multistep scheduler (ditcore.sampling)
SAMPLE_SOLVERS = (*SOLVERS, "unipc")
FEATURES = ("inception", "dinov2")  # ditcore.eval.features.feature_net: the network FID's statistics are taken with

# The objective: preconditioning (ditcore.diffusion: EDMPrecond, or vp.VPPrecond around a DDPM ε-network), the loss
# (EDMLoss, or ddpm.DDPMLoss), what the network outputs (EDMPrecond's prediction) and DDPM's beta schedules.
OBJECTIVES = ("edm", "flow")  # EDM (ditcore.diffusion.edm) or rectified flow (ditcore.diffusion.flow)
T_DISTS = ("logit_normal", "uniform")  # how flow matching draws its training t (ditcore.diffusion.flow.FlowLoss)
PRECONDS = ("edm", "vp")
LOSSES = ("edm", "ddpm")
PREDICTIONS = ("edm", "x")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")

# dit-prepare's latent codecs (PatchPCACodec, PixelCodec, DiffusersVAECodec of ditcore.codecs, each of which records
# its own kind in a dataset's ditcore.json), and the diffusers VAE classes that ditcore.codecs.vae loads.
CODEC_NAMES = ("pca", "pixel", "vae")
VAE_CLASSES = ("AutoencoderKL", "AutoencoderTiny", "AutoencoderKLWan")
# dit-prepare's text encoders (ditcore.codecs.text.load_text_encoder, whose name a dataset records): the ones named
# alone, and the families named "<family>:<hub id or folder>" (T5, as in the reference recipe; UMT5, Wan 2.1's).
TEXT_ENCODERS = ("minilm", "null")
TEXT_ENCODER_FAMILIES = ("t5", "umt5")

# The job's layout: the choices of ditcore.job.Layout's fields that are not numbers, which Layout checks and
# dit-train's config offers (with `auto` where dit-train decides): activation checkpointing
# (ditcore.models.techniques), when FSDP gathers and reduces (ditcore.parallel.fsdp), the attention kernels
# (ditcore.models.attention, whose `auto` is flex on a GPU), the dtypes and the device.
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")
FSDP_SYNCS = ("micro_batch", "step")
ATTENTION = ("sdpa", "flex")
LAYOUT_CHOICES = {"reduce_dtype": ("fp32", "bf16"), "fsdp_sync": FSDP_SYNCS, "precision": ("bf16", "fp32"),
                  "activation_checkpointing": ACTIVATION_CHECKPOINTING, "device": ("cuda", "cpu"),
                  "attention": ATTENTION}
