"""ditcore.quiet silences the third-party messages it names, from the modules that issue them, and nothing else."""

import warnings

import pytest

from ditcore import quiet

TE = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
PIN = "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory won't be used."


def shown(message: str, module: str, category=UserWarning) -> bool:
    """Whether a warning issued from `module` reaches the user once the filters are installed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every other warning shows, each time
        quiet.third_party()  # in front of it
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return bool(caught)


@pytest.mark.parametrize(("message", "module", "category", "silenced"), [
    (TE, "megatron.core.optimizer", UserWarning, True),
    (TE, "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision", UserWarning, True),
    (PIN, "torch.utils.data.dataloader", UserWarning, True),
    (TE, "some_other_package", UserWarning, False),  # the same words elsewhere are not ours to hide
    ("something else entirely", "megatron.core.optimizer", UserWarning, False),  # Megatron's other warnings show
    (TE, "megatron.core.optimizer", DeprecationWarning, False),
])
def test_only_the_named_messages_from_their_modules_are_silenced(message, module, category, silenced):
    assert shown(message, module, category) is not silenced
