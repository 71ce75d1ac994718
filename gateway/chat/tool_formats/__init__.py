"""The tool-call formats, one module per format (each defines ``FORMAT``); ``gateway.chat.tool_parsers`` lists them
by SGLang's ``--tool-call-parser`` names. What they share is in ``base``."""
