"""A bundled set of varied chat prompts for self-distillation (``axon train-eagle3``).

No data set can be downloaded here, so prompts are composed: question templates crossed with
subjects, plus standalone requests (how-to, code, arithmetic, writing, advice). The held-out
split has its own subjects and standalone requests, so that an acceptance measured on it is not
measured on topics the head was trained on.
"""

from __future__ import annotations

import itertools
import random

TEMPLATES = (
    "Explain {} in simple terms.",
    "What is {}?",
    "Give me three interesting facts about {}.",
    "Write a short poem about {}.",
    "Write a haiku about {}.",
    "Summarize what you know about {} in one paragraph.",
    "Why does {} matter?",
    "How would you explain {} to a ten-year-old?",
    "What are common misconceptions about {}?",
    "Write a short story that involves {}.",
    "Tell me a fun fact about {}.",
    "Describe {} in three sentences.",
    "Write a tweet about {}.",
    "Write a quiz question about {}, with its answer.",
    "What is the history of {}?",
    "How does {} affect everyday life?",
    "Give an analogy that explains {}.",
    "What should a beginner know about {}?",
    "Write a limerick about {}.",
    "List five keywords related to {} and explain each briefly.",
)

SUBJECTS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "machine learning",
    "compound interest",
    "volcanoes",
    "honeybees",
    "the Roman Empire",
    "climate change",
    "the human heart",
    "electricity",
    "the internet",
    "gravity",
    "DNA",
    "the moon",
    "coffee",
    "chess",
    "jazz music",
    "the Great Wall of China",
    "recycling",
    "rainbows",
    "dinosaurs",
    "the stock market",
    "vaccines",
    "the printing press",
    "earthquakes",
    "penguins",
    "solar panels",
    "the Olympic Games",
    "friendship",
    "time management",
    "the ocean",
    "bread baking",
    "the immune system",
    "democracy",
    "the Renaissance",
    "electric cars",
    "the Amazon rainforest",
    "sleep",
    "mathematics",
    "the solar system",
    "cats",
    "dogs",
    "trees",
    "the speed of light",
    "ancient Egypt",
    "social media",
    "cloud computing",
    "bicycles",
    "the piano",
    "gardening",
    "the alphabet",
    "snowflakes",
    "deserts",
    "the brain",
    "bridges",
    "money",
    "libraries",
    "airplanes",
    "hurricanes",
    "the periodic table",
    "soccer",
    "meditation",
    "nutrition",
    "robots",
    "the Moon landing",
    "coral reefs",
    "the Industrial Revolution",
    "wind energy",
    "languages",
    "mountains",
    "chocolate",
    "the human eye",
    "video games",
    "rivers",
    "batteries",
    "the Silk Road",
    "whales",
    "origami",
    "the camera",
    "tea",
    "fungi",
    "magnets",
    "the calendar",
    "public speaking",
    "cooking pasta",
    "the night sky",
    "glaciers",
    "owls",
    "the telephone",
    "kindness",
    "running",
    "bees and flowers",
    "the Pyramids",
    "weather forecasting",
    "programming",
    "tides",
    "the Eiffel Tower",
    "butterflies",
    "saving money",
    "ancient Greece",
    "viruses",
    "the number zero",
    "lighthouses",
    "musical instruments",
    "volunteering",
    "maps",
    "sharks",
    "the Sahara",
    "algorithms",
    "rain",
    "castles",
    "the violin",
)

STANDALONE = (
    "How do I make a good cup of tea?",
    "Write a Python function that reverses a string.",
    "What is 15 times 12?",
    "Suggest a name for a small bakery.",
    "How can I improve my sleep?",
    "Write an email to my manager asking for a day off on Friday.",
    "Translate 'good morning, how are you?' into French.",
    "What are some tips for a job interview?",
    "Write a Python function that checks whether a number is prime.",
    "How do I center a div in CSS?",
    "What is the difference between a list and a tuple in Python?",
    "Give me a recipe for pancakes.",
    "Plan a one-day trip to Paris.",
    "What should I pack for a weekend camping trip?",
    "Write a thank-you note to a friend who helped me move.",
    "How do I start learning to play the guitar?",
    "What is the capital of Australia?",
    "Explain the rules of tic-tac-toe.",
    "Write a SQL query that selects all users older than 30.",
    "How many days are there in a leap year?",
    "Write a motivational message for someone starting a new job.",
    "What are the benefits of drinking water?",
    "How do I write a good resume?",
    "Give me five ideas for a birthday party.",
    "Write a JavaScript function that sums an array of numbers.",
    "What is the square root of 144?",
    "How do I change a flat tire?",
    "Describe a perfect summer day.",
    "What are good habits for studying?",
    "Write a short dialogue between a cat and a dog.",
    "How can I reduce stress at work?",
    "Write a product description for a reusable water bottle.",
    "What is a healthy breakfast?",
    "How do I make a paper airplane?",
    "Write a bash command that counts the lines in a file.",
    "If I have 3 apples and buy 5 more, how many do I have?",
    "What is the boiling point of water in Fahrenheit?",
    "Give me tips for taking better photos with my phone.",
    "Write a birthday message for my grandmother.",
    "How do I stay focused while working from home?",
    "What are the primary colors?",
    "Write a Python class for a simple bank account.",
    "How do I politely decline an invitation?",
    "Suggest three books for someone who likes science fiction.",
    "What is the difference between weather and climate?",
    "How do I boil an egg?",
    "Write an apology message for missing a meeting.",
    "Give me a workout plan for beginners.",
    "What does HTTP stand for?",
    "How can I be more productive in the morning?",
    "Write a story opening that starts with a knock at the door.",
    "What is 250 divided by 5?",
    "Explain what a for loop does in programming.",
    "Give me ideas for a rainy day at home.",
    "How do I take care of a houseplant?",
    "Write a short speech for a friend's wedding.",
    "What are the planets in our solar system?",
    "How do I make my password more secure?",
    "Write a Python function that returns the factorial of a number.",
    "What is a noun? Give some examples.",
    "How do I learn a new language quickly?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Write a to-do list for cleaning the kitchen.",
    "How can I save money on groceries?",
    "What is the largest animal on Earth?",
    "Write a regular expression that matches an email address.",
    "How do I prepare for a marathon?",
    "What are three ways to be kind to others?",
    "Write a cover letter opening for a teaching job.",
    "Convert 10 kilometers to miles.",
    "How do I write a haiku?",
    "What is the difference between RAM and storage?",
    "Give me a list of fun science experiments for kids.",
    "Write a short review of an imaginary restaurant.",
    "How can I make new friends in a new city?",
    "What is the Pythagorean theorem?",
    "Write a Python one-liner that squares every number in a list.",
    "How should I organize my desk?",
    "What causes the seasons on Earth?",
    "Write a polite reminder email about an unpaid invoice.",
)

# A second user turn, asked after the target's first answer in the same conversation: the answer
# to it is another greedy answer, written with the first one in its context.
FOLLOW_UPS = (
    "Tell me more.",
    "Can you give an example?",
    "Explain that more simply.",
    "Why is that?",
    "What else should I know?",
    "Summarize that in one sentence.",
    "Can you make it shorter?",
    "Say it again in a different way.",
    "What is the most important part?",
    "Thanks! Anything to add?",
    "Continue.",
    "Can you put that as a list?",
)

_HELD_OUT_EVERY = 8  # every 8th subject and standalone prompt belongs to the held-out split


def chat_prompts(num_prompts: int, seed: int, held_out: bool = False) -> list[str]:
    """``num_prompts`` distinct user messages of one split, in a seeded order: about one in four
    a standalone request, the rest a template about a subject. Raises past the split's size."""
    subjects = _split(SUBJECTS, held_out)
    standalone = _split(STANDALONE, held_out)
    rng = random.Random(seed)
    composed = [t.format(s) for t, s in itertools.product(TEMPLATES, subjects)]
    rng.shuffle(composed)
    standalone = list(standalone)
    rng.shuffle(standalone)
    available = len(composed) + len(standalone)
    if num_prompts > available:
        split = "held-out" if held_out else "training"
        raise ValueError(f"num_prompts {num_prompts} exceeds the {available} bundled {split} prompts")
    prompts: list[str] = []
    while len(prompts) < num_prompts:
        pool = standalone if (len(prompts) % 4 == 3 and standalone) or not composed else composed
        prompts.append(pool.pop())
    return prompts


def _split(items: tuple[str, ...], held_out: bool) -> list[str]:
    return [x for i, x in enumerate(items) if (i % _HELD_OUT_EVERY == 0) == held_out]


def chat_dialogues(num_prompts: int, seed: int, follow_ups: int, held_out: bool = False) -> list[list[str]]:
    """``chat_prompts``, each followed by ``follow_ups`` distinct follow-up messages (seeded):
    the user turns of one conversation each."""
    if not 0 <= follow_ups <= len(FOLLOW_UPS):
        raise ValueError(f"follow_ups must be from 0 to {len(FOLLOW_UPS)}, got {follow_ups!r}")
    rng = random.Random(seed + 1)
    return [[p, *rng.sample(FOLLOW_UPS, follow_ups)] for p in chat_prompts(num_prompts, seed, held_out)]
