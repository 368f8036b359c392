"""The markers of Gemma 4's chat format that qat4 reads and writes (special tokens of its
vocabulary): turns, the thought channel, tool calls and their string delimiter."""

BOS = "<bos>"
THOUGHT_OPEN = "<|channel>"
THOUGHT_CLOSE = "<channel|>"
THOUGHT_LABEL = "thought"
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
CALL_PREFIX = "call:"
STRING_DELIM = '<|"|>'
TURN_CLOSE = "<turn|>"
RESPONSE_OPEN = "<|tool_response>"
EOS_TEXT = "<eos>"
# Where the reply parser ends a reply: the format's ends of a model turn. The ids a generation stops
# on are the checkpoint's (qat4.engine.Engine.stop_token_ids, these three for Gemma 4); a reply the
# engine ended on one never holds it as text.
STOP_MARKERS = (TURN_CLOSE, RESPONSE_OPEN, EOS_TEXT)
