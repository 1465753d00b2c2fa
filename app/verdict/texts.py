"""Real English text the benchmarks cut prompts from (written for Hearth; no external corpus)."""

PASSAGES = [
    "The kitchen timer rang twice before anyone noticed. Outside, the rain had turned the garden path "
    "into a shallow stream, and the cat sat on the windowsill watching drops race each other down the "
    "glass. Grandmother wanted to know whether the bread needed another ten minutes, and the answer, as "
    "always, depended on who you asked. The recipe card, stained with decades of butter, said forty "
    "minutes at a moderate heat; the oven, which had opinions of its own, disagreed.",
    "Summarise the following meeting notes for the household calendar. The school trip moved from "
    "Thursday to Friday because the bus company had a scheduling conflict. Parents must sign the consent "
    "form by Wednesday evening and pack a lunch without nuts. The football match on Saturday starts at "
    "nine instead of ten, and the team needs two more drivers. The library books are due on Monday, and "
    "the fine for late returns doubled this term.",
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping closed intervals and return them sorted.\"\"\"\n"
    "    result = []\n    for start, end in sorted(intervals):\n        if result and start <= result[-1][1]:\n"
    "            result[-1][1] = max(result[-1][1], end)\n        else:\n            result.append([start, end])\n"
    "    return result\n\n# Explain what this function does, its complexity, and write three unit tests.",
    "A continuous-batching server re-decides at every decode step which sequences run. New requests join "
    "as soon as a slot and enough key-value cache are free, and finished ones leave immediately, so a "
    "short answer never waits for the longest answer in its batch. Streaming only changes when text is "
    "delivered; batching changes how requests share the model's execution. Whether the gain is worth it "
    "depends on how often requests overlap.",
    "Dear neighbours, the residents' association will meet in the community hall next Tuesday at seven. "
    "On the agenda: the new recycling schedule, the broken streetlight at the corner of Elm Road, a "
    "proposal to plant fruit trees along the park fence, and the budget for the winter market. Tea and "
    "biscuits will be served. If you cannot attend, please send your questions in advance so that the "
    "committee can answer them in the minutes.",
    "Turn on the living room lights and set the thermostat to twenty degrees. Then tell me whether I "
    "need an umbrella tomorrow morning, and remind me at six to call the plumber about the dripping tap "
    "in the upstairs bathroom.",
    "The history of the bicycle is a history of small improvements. Early machines had no pedals; riders "
    "pushed along the ground with their feet. Pedals on the front wheel came next, which led to enormous "
    "front wheels for speed and to many painful falls. The chain drive, equal-sized wheels and pneumatic "
    "tyres finally produced the safety bicycle, whose basic shape has barely changed in more than a "
    "century, even as materials went from steel to aluminium and carbon fibre.",
    "Write a short bedtime story about a lighthouse keeper who befriends a seagull that cannot fly, in "
    "which they work together to guide a lost fishing boat home through a storm, and end it with a "
    "gentle lesson about asking for help.",
]


def corpus() -> str:
    """All passages joined, long enough to cut prompts of a few hundred tokens from."""
    return "\n\n".join(PASSAGES * 3)
