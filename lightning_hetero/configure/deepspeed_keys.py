"""Configure: the check that a user's DeepSpeed config has only keys DeepSpeed knows, of the types it reads them as.

DeepSpeed ignores an unknown top-level key and compares a string as if it were a number without a word, so the
strategy parses the config the way DeepSpeed does, through a recording dict, in its constructor. Kept apart from
:mod:`.deepspeed_config` (which builds each rank's config) because it leans on DeepSpeed's private config parser.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import KeysView, Mapping
from typing import Any, Optional

from lightning_hetero.runtime.checks import is_int, is_real

# Top-level keys DeepSpeed reads outside DeepSpeedConfig._initialize_params (deepspeed/__init__.py and the config's
# warning check), so the recording below does not see them.
_KEYS_READ_ELSEWHERE = frozenset({"sequence_parallel_size", "data_parallel_size", "vocabulary_size"})


def check_deepspeed_keys(config: Mapping[str, Any]) -> None:
    """Refuse a DeepSpeed config with a key DeepSpeed does not know, naming the closest valid key.

    DeepSpeed ignores an unknown top-level key without a word (``"zero_optimisation": {"stage": 3}`` silently ran
    ZeRO-2), while its sections are pydantic models that forbid extra keys. So this parses the config the way
    DeepSpeed does (``DeepSpeedConfig._initialize_params``, which needs no process group) through a dict that records
    which top-level keys DeepSpeed looks up: any other key is unknown. Section errors are rewritten to name the key
    path. The same recording gives the default DeepSpeed reads each top-level scalar with (``get(key, default)``,
    no type check of its own): a value of another type (``gradient_clipping: "1.0"``) is refused naming the key.
    Without that private method (another DeepSpeed version) the check is skipped, and DeepSpeed's own validation
    still runs at setup, on every rank alike.
    """
    try:
        import pydantic
        from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError, _reject_removed_config_keys
    except ImportError:  # pragma: no cover - another DeepSpeed layout
        return
    parse = getattr(DeepSpeedConfig, "_initialize_params", None)
    if parse is None:  # pragma: no cover
        return
    try:
        _reject_removed_config_keys(config)  # DeepSpeed's own message for a removed feature
    except DeepSpeedConfigError as error:
        raise ValueError(f"The DeepSpeed config is invalid: {error}") from None
    recorded = _RecordingDict(copy.deepcopy(dict(config)))
    parsed = True
    try:
        parse(object.__new__(DeepSpeedConfig), recorded)
    except pydantic.ValidationError as error:
        raise ValueError(_section_error_message(recorded.last_key, error)) from None
    except (DeepSpeedConfigError, AssertionError, ValueError, TypeError, KeyError):
        parsed = False  # DeepSpeed raises it again at setup, unless a value of the wrong type (below) explains it
    wrong = [
        line
        for key, default in recorded.defaults.items()
        if key in config
        for line in [_wrong_scalar_type(key, config[key], default)]
        if line
    ]
    if wrong:
        raise ValueError(
            f"The DeepSpeed config has values of the wrong type: {'; '.join(wrong)}. DeepSpeed does not check these"
            " and would fail later (at the first step) or compare a string as if it were a number. Fix the values"
            " (in YAML or JSON, a number without quotes)."
        )
    if not parsed:
        return  # only unknown keys are ours to find, and the keys after the failure were not looked up
    known = recorded.looked_up | _KEYS_READ_ELSEWHERE
    unknown = [key for key in config if key not in known]
    if unknown:
        lines = [f"`{key}`{_did_you_mean(key, known)}" for key in unknown]
        raise ValueError(
            f"The DeepSpeed config has keys DeepSpeed does not know: {', '.join(lines)}. DeepSpeed would ignore them"
            " without a word, so those settings would have no effect. Fix the spelling or remove them."
        )


def _wrong_scalar_type(key: str, value: Any, default: Any) -> Optional[str]:
    """Why ``value`` cannot stand where DeepSpeed's default for ``key`` is ``default``; None when it can.

    DeepSpeed reads its top-level scalar settings with ``param_dict.get(name, default)`` and no type check, so the
    default's type is the expected one (a default of None says nothing).
    """
    if default is None or value is None:
        return None
    if isinstance(default, bool):
        expected, fits = "true or false", isinstance(value, bool)
    elif isinstance(default, int):
        expected, fits = "an integer", is_int(value)
    elif isinstance(default, float):
        expected, fits = "a number", is_real(value)
    elif isinstance(default, str):
        expected, fits = "a string", isinstance(value, str)
    else:
        return None
    if fits:
        return None
    return f"`{key}={value!r}` ({type(value).__name__}) must be {expected} (DeepSpeed's default is {default!r})"


class _RecordingDict(dict):
    """A dict that remembers which keys were looked up (and the last one: the section being parsed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.looked_up: set[str] = set()
        self.last_key: Optional[str] = None
        self.defaults: dict[str, Any] = {}  # key -> the default DeepSpeed reads it with (`get(key, default)`)

    def _saw(self, key: Any) -> None:
        self.looked_up.add(key)
        self.last_key = key

    def __getitem__(self, key: Any) -> Any:
        self._saw(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._saw(key)
        self.defaults.setdefault(key, default)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._saw(key)
        return super().__contains__(key)

    # DeepSpeed writes `KEY in param_dict.keys()` too; only `in` is used on the view (not dict_keys' `.mapping`).
    def keys(self) -> KeysView:  # type: ignore[override]
        return _RecordingKeys(self)


class _RecordingKeys(KeysView):
    _mapping: _RecordingDict  # (KeysView's slot, which the stubs leave undeclared)

    def __contains__(self, key: object) -> bool:
        return key in self._mapping  # (records through _RecordingDict.__contains__)


def _section_error_message(section: Optional[str], error: Any) -> str:
    problems = []
    for item in error.errors(include_url=False):
        path = ".".join(str(part) for part in (section, *item["loc"]) if part is not None)
        if item["type"] == "extra_forbidden":
            hint = _did_you_mean(str(item["loc"][-1]), _model_fields(error.title)) if len(item["loc"]) == 1 else ""
            problems.append(f"`{path}` is not a DeepSpeed setting{hint}")
        else:
            problems.append(f"`{path}={item.get('input')!r}`: {item['msg']}")
    return f"The DeepSpeed config is invalid: {'; '.join(problems)}. Fix or remove those entries."


def _model_fields(model_name: str) -> set[str]:
    """The field names (and aliases) of the DeepSpeed config model called ``model_name``."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    pending, names = [DeepSpeedConfigModel], set()
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        if model.__name__ == model_name:
            for name, field in model.model_fields.items():
                names.add(field.alias or name)
    return names


def _did_you_mean(key: str, candidates: Any) -> str:
    close = difflib.get_close_matches(key, sorted(str(c) for c in candidates), n=1, cutoff=0.6)
    return f" (did you mean `{close[0]}`?)" if close else ""
