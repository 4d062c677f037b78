"""Bridge's ``pretrain`` names ``CallWrapper`` in a type hint; in-process restart itself is refused."""


class CallWrapper:
    """Never built here: in-process restart needs the real nvidia-resiliency-ext."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("in-process restart needs nvidia-resiliency-ext; this is the Bridge tier's stand-in")
