"""The one exception type the CLI turns into a one-line message and exit code 2."""


class HotcoldError(Exception):
    """A user-facing error: the message names the file or field and says what to do."""


class ModelFileError(HotcoldError):
    """A model path or file is missing, truncated or not what it claims to be."""


class UnsupportedModelError(HotcoldError):
    """The model's architecture or a feature of its config is not supported."""


class ContextLengthError(HotcoldError):
    """A prompt (plus requested tokens) does not fit in the model's context."""
