"""Test and benchmark doubles. Nothing on the serving path imports them unless a flag asks
(``--vllm-omni-standin``), and they import nothing else of duplexserve."""

#: The model name the vLLM-Omni stand-in reports. It lives here, apart from the stand-in, so
#: the server can name the model without importing vLLM-Omni before the engine is built.
STANDIN_MODEL = "duplexserve/standin-echo"
