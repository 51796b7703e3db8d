"""The names of the library's choices that the apps offer, in a module that imports nothing: each list's one home,
read by the code that implements the choices and by the CLIs, whose --help lists them without importing torch.
A new solver, feature network, objective or codec is named here and implemented where its list is checked."""

SOLVERS = ("heun", "euler")  # ditcore.diffusion.sampler.edm_sampler: Algorithm 2's second-order step, or its Euler part
# ditcore.diffusion.flow: flow_sampler's Euler and Heun steps on the flow ODE, or diffusers' UniPCMultistepScheduler
# with flow sigmas (Wan's sampler) through scheduler_sampler
FLOW_SOLVERS = ("euler", "heun", "unipc")
# what dit-sample and validation offer: either objective's (ditcore.sampling.sample refuses unipc for EDM)
SAMPLE_SOLVERS = tuple(dict.fromkeys((*SOLVERS, *FLOW_SOLVERS)))
FEATURES = ("inception", "dinov2")  # ditcore.eval.features.feature_net: the network FID's statistics are taken with

# The objective: preconditioning (ditcore.diffusion: EDMPrecond, or vp.VPPrecond around a DDPM ε-network), the loss
# (EDMLoss, or ddpm.DDPMLoss), what the network outputs (EDMPrecond's prediction) and DDPM's beta schedules.
PRECONDS = ("edm", "vp")
LOSSES = ("edm", "ddpm")
PREDICTIONS = ("edm", "x")
# The training objective: EDM's denoiser (above), or flow matching (ditcore.diffusion.flow: rectified flow, the network
# predicts the velocity) with its distributions of t before the time shift (logit-normal as SD3, or uniform)
OBJECTIVES = ("edm", "flow")
T_DISTRIBUTIONS = ("logit_normal", "uniform")
FLOW_PREDICTIONS = ("velocity", "x")  # what a flow network outputs (ditcore.diffusion.flow.FlowPrecond)
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
