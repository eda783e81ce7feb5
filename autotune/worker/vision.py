"""Vision-language trials (Qwen2.5-VL): the processor, the synthetic images, the prompts.

A VL trial must meet the real run's worst case too: the language model sees
``max_prompt_length`` text tokens plus ``images_per_prompt x image_tokens`` image tokens per
prompt, and the vision tower runs over ``image_tokens x spatial_merge_size**2`` patches per image.
Image *contents* do not change memory or speed, only their sizes do, so the images are synthetic:

* **Size.** Qwen2.5-VL cuts an image of H x W pixels into ``patch_size`` squares and merges
  ``spatial_merge_size**2`` of them into one LLM token, so an image is
  ``(H / patch / merge) x (W / patch / merge)`` tokens. :func:`image_grid` picks the most square
  factorisation of ``image_tokens`` and :func:`image_pixels` the size that gives it; the image
  processor's pixel bounds are set to exactly that area, so its ``smart_resize`` keeps it as is.
* **Processor.** Built offline, like the tokenizer: the image processor with the vision config's
  patch, merge and temporal sizes, and the synthetic tokenizer (which spells the config's vision
  ids ``<|vision_start|>``, ``<|image_pad|>``, ... so the processor finds them). It is
  :func:`image_only_processor`: Qwen2.5-VL's own processor class minus its video processor.
  transformers 5 constructs the video processor only with torchvision, and a trial feeds no video.
* **Prompts.** TRL 1.16's VL format: a conversational ``prompt`` column and an ``images`` column
  (TRL inserts one image block per image before the user's text). The text is filled until the
  prompt, rendered and tokenised exactly as TRL does (``processor.apply_chat_template(...,
  tokenize=True)``, chat markers and ``<|vision_start|>``/``<|vision_end|>`` included), is
  ``max_prompt_length + images x image_tokens`` tokens; that is checked, not assumed.

transformers, TRL and Pillow are imported inside the functions (see :mod:`autotune.worker`).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.worker.console import say
from autotune.worker.tokenizer import token_word

__all__ = [
    "CHAT_TEMPLATE",
    "build_processor",
    "image_grid",
    "image_pixels",
    "is_vision",
    "report_vision",
    "vision_dataset",
]

#: Qwen's aspect-ratio limit in ``smart_resize`` (it refuses a longer side over 200 x the shorter).
MAX_ASPECT = 200
#: A role line per message and one image block per image, in the Qwen-VL layout (role, image
#: placeholders, text); written for the word-level tokenizer, where whitespace only separates.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }} {% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def is_vision(config: dict[str, Any]) -> bool:
    """Whether a model config has a vision tower (``vision_config``)."""
    return bool(config.get("vision_config"))


def image_grid(image_tokens: int) -> tuple[int, int]:
    """(rows, columns) of merged tokens, ``rows x columns == image_tokens``, as square as possible.

    Raises UsageError for a count whose only factorisations are thinner than Qwen's 1:200 limit
    (a prime above 200): no image has exactly that many tokens.
    """
    k = int(image_tokens)
    if k < 1:
        raise UsageError(f"--image-tokens must be at least 1 for an image (got {k})")
    rows = next(r for r in range(math.isqrt(k), 0, -1) if k % r == 0)
    cols = k // rows
    if cols / rows > MAX_ASPECT:
        raise UsageError(
            f"--image-tokens {k}: no image is exactly {k} tokens (its only grid is {rows} x {cols}, "
            f"beyond Qwen-VL's 1:{MAX_ASPECT} aspect limit); pick a number with a factor pair, "
            f"e.g. {k - 1} or {k + 1}"
        )
    return rows, cols


def _vision_sizes(config: dict[str, Any]) -> tuple[int, int, int]:
    vision = config["vision_config"]
    return (
        int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        int(vision.get("spatial_merge_size", 2)),
        int(vision.get("temporal_patch_size", 2)),
    )


def image_pixels(config: dict[str, Any], image_tokens: int) -> tuple[int, int]:
    """(height, width) in pixels of an image that becomes exactly ``image_tokens`` LLM tokens."""
    patch, merge, _ = _vision_sizes(config)
    rows, cols = image_grid(image_tokens)
    return rows * patch * merge, cols * patch * merge


def image_only_processor() -> Any:
    """Qwen2.5-VL's processor class with no video processor.

    transformers derives a processor's sub-processors from its ``__init__`` signature
    (``ProcessorMixin.get_attributes``) and type-checks each one; the video processor's check
    needs torchvision's registry, so without torchvision the stock class cannot be built at all,
    not even with ``video_processor=None``. Leaving ``video_processor`` out of the signature makes
    the processor image+text only, which is all a trial feeds. Everything else (image-token
    expansion, ``mm_token_type_ids``, the chat template) is the stock class's.
    """
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        def __init__(
            self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
        ) -> None:
            # the parent passes video_processor=None positionally; ProcessorMixin pairs the
            # arguments with this signature's two sub-processors and ignores the third
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnlyQwen2_5_VLProcessor


def _image_processor(config: dict[str, Any], image_tokens: int) -> Any:
    """The torchvision image processor where torchvision is installed (what ``AutoProcessor`` picks),
    else the PIL one; sizes from the vision config, pixel bounds exactly the synthetic image's area."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as cls
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    patch, merge, temporal = _vision_sizes(config)
    height, width = image_pixels(config, image_tokens)
    area = height * width
    return cls(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=temporal,
        size={"shortest_edge": area, "longest_edge": area},
    )


def _has_processor_files(path: Path | str | None) -> bool:
    return path is not None and (Path(path) / "preprocessor_config.json").is_file()


def build_processor(
    tokenizer: Any, config: dict[str, Any], image_tokens: int, path: Path | str | None = None
) -> Any:
    """The trial's processor: the checkpoint's own when its folder has one (``AutoProcessor``,
    offline), else the offline image-only Qwen2.5-VL processor around ``tokenizer``."""
    if _has_processor_files(path):
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
        height, width = image_pixels(config, image_tokens)
        processor.image_processor.size = {"shortest_edge": height * width, "longest_edge": height * width}
        return processor
    return image_only_processor()(
        image_processor=_image_processor(config, image_tokens),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def _images(config: dict[str, Any], image_tokens: int, count: int, seed: int) -> list[Any]:
    """``count`` RGB noise images of the size that gives ``image_tokens`` tokens."""
    from PIL import Image

    height, width = image_pixels(config, image_tokens)
    rng = random.Random(seed)
    return [Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)) for _ in range(count)]


def _rendered_length(processor: Any, text: str, images: list[Any]) -> tuple[int, int]:
    """(all tokens, image tokens) of one prompt as TRL 1.16 tokenises it for generation."""
    from trl.data_utils import prepare_multimodal_messages

    messages = prepare_multimodal_messages([{"role": "user", "content": text}], images=images)
    out = processor.apply_chat_template(
        [messages], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    ids = list(out["input_ids"][0])
    image_id = processor.tokenizer.convert_tokens_to_ids(getattr(processor, "image_token", "<|image_pad|>"))
    return len(ids), sum(1 for i in ids if i == image_id)


def vision_dataset(
    processor: Any,
    config: dict[str, Any],
    length: int,
    image_tokens: int,
    images_per_prompt: int,
    rows: int,
    seed: int = 0,
) -> Any:
    """A ``datasets.Dataset`` of ``rows`` conversational prompts, each with ``images_per_prompt``
    synthetic images, that the model sees as exactly ``length + images x image_tokens`` tokens.

    The chat markers and vision delimiters are counted inside ``length`` (they are text the
    model reads), so the text is ``length`` minus those; a prompt length too short to hold them
    is refused in one line.
    """
    from datasets import Dataset

    from autotune.worker.data import is_synthetic, one_token_filler, ordinary_ids

    tokenizer = processor.tokenizer
    images = _images(config, image_tokens, images_per_prompt, seed)
    target_images = images_per_prompt * image_tokens
    target = int(length) + target_images
    rng = random.Random(seed)
    if is_synthetic(tokenizer):
        ids = ordinary_ids(tokenizer)

        def text_of(n: int) -> str:  # n random ordinary words, one token each: a fresh text per call
            return " ".join(token_word(rng.choice(ids)) for _ in range(n))
    else:
        filler = one_token_filler(tokenizer)

        def text_of(n: int) -> str:
            return filler * n

    total, seen_images = _rendered_length(processor, text_of(0), images)
    overhead = total - target_images
    if seen_images != target_images:
        raise UsageError(
            f"the processor made {seen_images} image tokens of {images_per_prompt} image(s), "
            f"not {target_images}: the vision config's patch/merge sizes disagree with its processor"
        )
    if overhead > length:
        raise UsageError(
            f"--max-prompt-length {length} cannot hold the chat markers and image delimiters "
            f"({overhead} tokens); use at least {overhead}"
        )
    n = length - overhead
    for _ in range(16):
        total, _ = _rendered_length(processor, text_of(n), images)
        if total == target:
            break
        n += target - total
    else:
        raise UsageError(f"could not make a VL prompt of exactly {target} tokens with this processor")
    say(
        f"prompt tokens as the model sees them: {total} "
        f"({length} text incl. {overhead} chat/vision markers + "
        f"{images_per_prompt} x {image_tokens} image tokens, images {images[0].height}x{images[0].width} px)"
    )
    # a text per row, the same images in every row: only their size matters
    prompts = [[{"role": "user", "content": text_of(n)}] for _ in range(rows)]
    return Dataset.from_dict({"prompt": prompts, "images": [images] * rows})


def report_vision(model: Any) -> None:
    """Say once, at the vision tower's first forward, what it runs over: the patches and images of
    that forward (generation's micro-batch). A trial's log then shows that the images reached the
    tower at the asked size, not only that the placeholders reached the language model."""
    tower = next((module for name, module in model.named_modules() if name.split(".")[-1] == "visual"), None)
    if tower is None:
        return

    def first_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        pixels = args[0] if args else kwargs.get("hidden_states")
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        images = (
            f" of {int(grid.shape[0])} image(s), grid {[int(v) for v in grid[0]]}" if grid is not None else ""
        )
        say(f"vision tower: {int(pixels.shape[0])} patches{images} in its first forward")

    handle = tower.register_forward_pre_hook(first_forward, with_kwargs=True)
