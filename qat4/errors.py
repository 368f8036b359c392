"""The one exception type users see: a single sentence naming what is wrong."""


class Qat4Error(Exception):
    """Bad input or an impossible request, described in one sentence.

    The CLI prints the message and exits non-zero; the server answers it as an HTTP 4xx.
    The message names the file, tensor, field or request parameter at fault.
    """
