"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes."""

from __future__ import annotations

from axon.engine.tokenizer import NO_TOKENIZER
from axon.entrypoints.openai.errors import bad_request
from axon.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from axon.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            _, token_ids, _ = await self.render_chat(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template,
                request.chat_template_kwargs,
                request.add_special_tokens,
            )
        else:
            token_ids = await self.encode(request.prompt, request.add_special_tokens, "prompt")
        token_strs = None
        if request.return_token_strs:
            token_strs = self.tokenizer.convert_ids_to_tokens(token_ids)
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        if self.tokenizer is None:
            raise bad_request(NO_TOKENIZER, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
