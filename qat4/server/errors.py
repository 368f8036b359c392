"""HTTP errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse


class APIError(Exception):
    """A request the server answers with an error status and one sentence."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        # Imported here: qat4.server.limits imports this module and every qat4 command's parser reads
        # those limits, so FastAPI at the top would add most of a second to `qat4 --help`, status and stop.
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def sentence(text: str) -> str:
    """`text` as a sentence: ending with a full stop."""
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, sentence(message), param=param, code=code)
