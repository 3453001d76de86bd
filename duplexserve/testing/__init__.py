"""Test and benchmark doubles. Nothing on the serving path imports them unless a flag asks
(``--vllm-omni-standin``), and they import nothing else of duplexserve."""
