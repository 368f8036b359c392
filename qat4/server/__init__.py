"""The OpenAI-compatible HTTP server: `create_app` in `qat4.server.app`, run by `qat4 serve`."""
