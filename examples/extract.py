"""Extraction into JSON that always parses: each reply is held to a JSON schema.

    python examples/extract.py                 # the bundled SmolLM2-135M-Instruct
    python examples/extract.py --model DIR     # any chat model (a directory or a .gguf)

Each sentence is asked for its person, city and year as JSON; ``Structure.json_schema`` holds
the reply to the schema (the city one of the listed ones, the year an integer), so every line
parses, whatever the model. The bundled model (135M parameters) gets the easy ones right;
harder text needs a larger model. The same request in an OpenAI Batch file:
``"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": {...}}}``.
"""
from __future__ import annotations

import argparse
import json

from flexgen_dist import LLM, SamplingConfig, Structure

CITIES = ["Paris", "London", "Rome", "Tokyo", "New York"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["person", "city", "year"],
          "properties": {"person": {"type": "string", "maxLength": 30}, "city": {"enum": CITIES},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100}}}
SENTENCES = [
    "In 1998 Maria moved to Paris to study painting.",
    "John visited Tokyo in 2015 for a conference.",
    "Aiko has lived in London since 2003.",
    "In 2021 Peter opened a bakery in Rome.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the bundled SmolLM2)")
    args = ap.parse_args()
    shaped = SamplingConfig(structure=Structure.json_schema(SCHEMA))
    chats = [[{"role": "user", "content": f"{s}\nGive the person, the city and the year as JSON."}] for s in SENTENCES]
    with LLM(args.model, progress=False) as llm:
        for sentence, c in zip(SENTENCES, llm.chat(chats, 48, shaped)):
            print(json.dumps(json.loads(c.text)), " <-", sentence)


if __name__ == "__main__":
    main()
