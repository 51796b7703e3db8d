"""Third-party messages that tell a user of our commands nothing, silenced in one place.

Each is matched by its own text and the module that issues it, never by category alone, so that any other warning
(from these libraries too) still shows. `third_party()` runs first in every command (ditcore.cli.entry_point),
before the libraries are imported: their warnings fire at import. Energon's progress bar is no warning: the loader
turns it off when it builds one (`energon_buffer_bar`), since importing Energon here would slow every command.
"""

from __future__ import annotations

import functools
import warnings

# (message regex, category, issuing module regex)
WARNINGS = (
    # Megatron-Core, at import of four of its modules, on any machine without Transformer Engine and Apex: we use
    # neither its fused optimizers nor its multi-tensor kernels, so the fallbacks it announces change nothing.
    (r"Transformer Engine and Apex are not installed", UserWarning, r"megatron\.core\."),
    # torch's DataLoader on a CPU-only machine: Energon's loader always asks for pinned memory, which only matters
    # where there is a GPU to copy to.
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning, r"torch\.utils\.data\."),
)


def third_party() -> None:
    """Install the warning filters (loader workers fork with them; installing them again changes nothing)."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


@functools.cache
def energon_buffer_bar() -> None:
    """Energon's packing dataset draws a "Filling reading buffer" tqdm bar whenever it starts filling its buffer
    (in every loader worker, every epoch), in the middle of dit-train's own bar; it has no option to turn it off, so
    its one call that asks for the bar is made without it. Loader workers are forked, so they inherit the change."""
    from megatron.energon.wrappers.packing_dataset import PackingDataset

    fill = PackingDataset._fill_reading_buffer

    @functools.wraps(fill)
    def without_bar(self, source_iter, log_progress: bool = False):
        return fill(self, source_iter, log_progress=False)

    PackingDataset._fill_reading_buffer = without_bar
