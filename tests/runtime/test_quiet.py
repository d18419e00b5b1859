"""Unit tests for runtime/quiet.py: known third-party noise is dropped inside the block, nothing else is."""

from __future__ import annotations

import logging
import warnings

from lightning_hetero.runtime import quiet


class Recorder(logging.Handler):
    """Records what reaches a logger's handlers (DeepSpeed's logger does not propagate to the root, caplog's)."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.DEBUG)
        self.logger = logging.getLogger(logger_name)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> Recorder:
        self.logger.addHandler(self)
        self.level_before = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def test_known_log_messages_are_dropped_only_inside_the_block():
    logger = logging.getLogger("DeepSpeed")
    with Recorder("DeepSpeed") as recorder, quiet.third_party_noise_silenced():
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("a DeepSpeed warning the user can act on")
    assert recorder.messages == ["a DeepSpeed warning the user can act on"]
    with Recorder("DeepSpeed") as recorder:
        logger.warning("Setting accelerator to CPU.")  # outside the strategy's calls: untouched
    assert recorder.messages == ["Setting accelerator to CPU."]


def test_known_warnings_are_dropped_at_their_source_only():
    """Filtered by category, message and the module that issues them: the same text from elsewhere still shows."""
    message = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use ..."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet._filter_warning_noise()  # what install_lasting_filters adds, in front of "always"
        warnings.warn_explicit(message, FutureWarning, "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
        warnings.warn_explicit(message, FutureWarning, "mine.py", 1, module="my_project.train")
        warnings.warn_explicit(message, UserWarning, "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
        warnings.warn("the user's own warning", UserWarning)
    assert [(str(w.message), w.category) for w in caught] == [
        (message, FutureWarning),  # another module
        (message, UserWarning),  # another category
        ("the user's own warning", UserWarning),
    ]


def test_lightning_tips_are_dropped_once_a_strategy_exists():
    quiet.install_lasting_filters()
    quiet.install_lasting_filters()  # idempotent
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(isinstance(f, quiet._DropMessages) for f in logger.filters) == 1
    with Recorder("lightning.pytorch.utilities.rank_zero") as recorder:
        logger.info("💡 Tip: For seamless cloud logging ...")
        logger.info("GPU available: False, used: False")
    assert recorder.messages == ["GPU available: False, used: False"]
