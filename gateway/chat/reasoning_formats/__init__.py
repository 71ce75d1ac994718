"""The reasoning formats, one module per kind (``think_tags``: ``<think>`` ... ``</think>`` and its variants,
``gpt_oss``: harmony's analysis channel); ``gateway.chat.reasoning`` lists them by SGLang's ``--reasoning-parser``
names. ``base`` says what a format provides."""
