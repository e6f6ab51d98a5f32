"""``axon router``: an OpenAI-compatible proxy in front of axon (or vLLM) servers, for
disaggregated prefill/decode (``--prefill URL... --decode URL...``) or plain replicas
(``--replica URL...``), optionally with encoder servers (``--encode URL...``).

A disaggregated request runs vLLM's protocol, so vLLM's proxies and this one are interchangeable:

    client --body--> router --body + kv_transfer_params {do_remote_decode: true, ...},
                               stream false, max_tokens 1--> prefill server
                    router <--{..., "kv_transfer_params": {...}}-- prefill server
                    router --body + the prefill's kv_transfer_params--> decode server
    client <--the decode server's answer, streamed chunk by chunk or whole-- router

With encoder servers (``--encode URL...``, encoder disaggregation, vLLM's EPD proxy), each
image of a chat is first sent alone, as a one-token chat, to an encoder server
(``--mm-encoder-only``), which stores its features (``--ec-transfer-config``); the chat then
goes on as above, and the servers it reaches load the features instead of encoding the images.
An image no encoder server takes is encoded by those servers themselves.

No request is lost to a failing backend: a prefill server that refuses, dies or answers 5xx passes
the request to the next one, and when none answers the decode server gets the original body and
computes the prompt itself. A replica or decode server that fails before the client saw a byte
passes it to the next of its role; one that fails mid-stream ends the client's stream with an
OpenAI-style error event. A 4xx (the client's input) is the client's answer, never retried. Dead
backends are marked down and probed on ``/health`` until they are back.
"""
