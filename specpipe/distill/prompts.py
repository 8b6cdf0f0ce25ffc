"""Training prompts for distillation: templated coding and chat requests whose answers the target writes.

A draft learns best from the target's own answers (FINDINGS: 2x the acceptance of generic text), and
data volume is the limit, so the tables below are wide rather than deep: many distinct tasks and
topics, several phrasings each. They are written to stay disjoint from the benchmark prompts
(specpipe/bench/prompts/), which tests check, so bench numbers are held-out numbers.
"""

from __future__ import annotations

import functools
import random

_CODE_PHRASINGS = [
    "Write a Python function that {task}.",
    "Write a function in Python that {task}.",
    "Implement a Python function that {task}, and explain how it works.",
    "How do I write a Python function that {task}?",
    "Create a short Python program that {task}.",
]

PYTHON_TASKS = [
    "reverses a string", "checks if a list is sorted", "computes the factorial of n recursively",
    "returns the greatest common divisor of two integers", "converts Celsius to Fahrenheit",
    "finds the second largest number in a list", "removes the vowels from a string",
    "counts the number of lines in a text file", "returns the n-th prime number",
    "checks whether two strings are anagrams", "transposes a matrix given as a list of lists",
    "computes the average of a list of numbers", "splits a list into chunks of size n",
    "returns the longest word in a sentence", "capitalizes the first letter of each word",
    "computes the dot product of two vectors", "finds all the duplicates in a list",
    "returns the intersection of two lists", "rotates a list by k positions", "checks if a year is a leap year",
    "converts a decimal number to binary", "parses a date string in YYYY-MM-DD format",
    "computes the median of a list", "validates an email address with a regular expression",
    "generates a random password of a given length", "reads a JSON file and returns its content as a dict",
    "writes a list of dictionaries to a CSV file", "computes the power set of a set",
    "returns all permutations of a string", "implements bubble sort", "implements quicksort",
    "implements insertion sort", "implements merge sort", "finds the maximum subarray sum",
    "counts the frequency of each character in a string", "checks if the parentheses in a string are balanced",
    "converts a Roman numeral to an integer", "converts an integer to a Roman numeral",
    "computes the Levenshtein distance between two strings", "finds the most common element in a list",
    "sums the digits of a number", "checks whether a number is a perfect square",
    "returns the Fibonacci sequence up to n", "removes duplicates from a list while keeping the order",
    "reverses the order of the words in a sentence", "counts the vowels in a string",
    "finds the minimum and the maximum of a list in one pass", "computes the area of a circle",
    "calculates compound interest", "returns all the factors of a number", "checks if a string contains only digits",
    "merges two dictionaries", "sorts a list of dictionaries by a given key", "groups words by their first letter",
    "finds the longest common prefix of a list of strings", "computes the running total of a list",
    "normalizes a list of numbers to the range 0 to 1", "computes a square root with Newton's method",
    "checks if a linked list has a cycle", "reverses a singly linked list", "computes the depth of a binary tree",
    "does an in-order traversal of a binary tree", "implements a queue using two stacks",
    "finds the k largest elements of a list with heapq", "counts the words in a file",
    "returns the n most common words in a text", "truncates a string to n characters and adds an ellipsis",
    "converts a string to snake_case", "converts a snake_case string to camelCase",
    "checks if a number is an Armstrong number", "computes the least common multiple of two numbers",
    "generates the first n rows of Pascal's triangle", "finds the missing number in a list of 1 to n",
    "computes the Hamming distance between two strings", "encrypts a string with a Caesar cipher",
    "compresses a string with run-length encoding", "finds all pairs in a list that sum to a target value",
    "returns the index of the first non-repeating character in a string", "calculates the body mass index",
    "returns the number of days between two dates", "checks if a matrix is symmetric", "multiplies two matrices",
    "flattens a nested dictionary", "finds the longest increasing subsequence of a list",
    "finds a peak element in a list", "implements a simple LRU cache", "memoizes another function with a decorator",
    "measures how long a function takes with a decorator", "retries a function three times when it raises",
    "prints the lines of a file that contain a keyword", "lists all the .txt files in a directory",
    "checks if a string is a valid IPv4 address", "extracts all the numbers from a string",
    "counts the uppercase letters in a string", "interleaves two lists", "zips two lists into a dictionary",
    "returns the cumulative product of a list", "checks if all the elements of a list are unique",
    "computes the standard deviation of a list", "returns the n-th triangular number",
    "converts hours and minutes to seconds", "formats a number with thousands separators",
    "splits a full name into a first and a last name", "checks if a list reads the same backwards",
    "removes all whitespace from a string", "finds the largest prime factor of a number",
    "counts the set bits of an integer", "returns the sum of the even numbers in a list",
    "filters the negative numbers out of a list", "squares every number in a list",
    "computes the product of all the numbers in a list", "shuffles a list without the random.shuffle function",
    "checks whether a string is a pangram", "converts a list of strings to uppercase",
    "finds the common elements of three lists", "returns the keys of a dictionary sorted by value",
    "computes the nth power of a number without using **", "checks whether a number is a palindrome",
    "converts a binary string to an integer", "counts how many times a substring occurs in a string",
    "returns the last n lines of a file", "replaces every occurrence of a word in a file",
    "builds a histogram of a list of numbers as a dict", "finds the index of the smallest element in a list",
    "computes the mean of each column of a 2D list", "checks if a string is a valid hexadecimal color code",
    "generates all the prime numbers below n with the sieve of Eratosthenes", "sorts a list of tuples by the second item",
    "counts the number of islands in a grid of 0s and 1s", "finds the shortest path in a grid with breadth-first search",
    "parses a query string into a dictionary", "pretty-prints a nested dictionary",
    "returns the difference between two lists", "converts seconds into a string like 1h 2m 3s",
]

_CLASS_PHRASINGS = [
    "Write a Python class `{name}` with {methods} methods.",
    "Implement a `{name}` class in Python with {methods}.",
]

PYTHON_CLASSES = [
    ("Queue", "enqueue, dequeue, size and is_empty"), ("BankAccount", "deposit, withdraw and get_balance"),
    ("Rectangle", "area, perimeter and is_square"), ("Counter", "increment, decrement and reset"),
    ("TodoList", "add_task, remove_task and list_tasks"), ("LinkedList", "append, prepend and delete"),
    ("Matrix", "add, multiply and transpose"), ("Circle", "area, circumference and diameter"),
    ("Student", "add_grade, average and best_grade"), ("Inventory", "add_item, remove_item and total_value"),
    ("Timer", "start, stop and elapsed"), ("Library", "add_book, borrow_book and return_book"),
    ("ShoppingCart", "add_item, remove_item and total"), ("Point", "distance_to and midpoint"),
    ("Vector2D", "add, scale and length"), ("Deck", "shuffle and deal"), ("Graph", "add_edge, neighbors and bfs"),
    ("MinHeap", "push, pop and peek"), ("Employee", "give_raise and describe"), ("Car", "accelerate, brake and honk"),
    ("Logger", "log, warn and clear"), ("Cache", "get, set and delete"), ("Fraction", "add, multiply and simplify"),
    ("Temperature", "to_celsius, to_fahrenheit and to_kelvin"), ("PhoneBook", "add_contact, find and remove"),
    ("Polynomial", "evaluate, add and derivative"), ("RingBuffer", "append, get and is_full"),
    ("Playlist", "add_song, next_song and shuffle"), ("Account", "login, logout and change_password"),
]

_OTHER_CODE = {
    "Write a JavaScript function that {task}.": [
        "reverses a string", "returns the largest number in an array", "capitalizes every word of a sentence",
        "counts the vowels in a string", "checks if a string is a palindrome", "flattens a nested array",
        "returns the sum of an array of numbers", "debounces another function", "deep clones an object",
        "sorts an array of objects by a property", "fetches JSON from a URL and logs it",
        "chunks an array into groups of n",
        "checks whether a number is prime", "converts a string to camelCase", "returns the intersection of two arrays",
        "formats a date as YYYY-MM-DD", "shuffles an array", "counts the occurrences of each element in an array",
    ],
    "Write a SQL query that {task}.": [
        "lists all employees whose salary is above the average", "counts the orders placed in each month",
        "finds the products that have never been ordered", "returns the second highest salary",
        "joins the customers and orders tables and shows each customer's total spending",
        "deletes duplicate rows from a table", "finds the department with the most employees",
        "lists the five most recent orders", "returns the average price per category", "finds customers with no orders",
        "updates the price of every product in a category by ten percent",
        "shows the number of users who signed up each day",
        "creates a table for storing blog posts", "finds all the employees who report to a given manager",
    ],
    "Write a bash script that {task}.": [
        "counts the lines in every .py file in a folder", "backs up a directory into a dated tar.gz archive",
        "renames all .jpeg files to .jpg", "checks whether a website is reachable",
        "prints the disk usage of each folder",
        "deletes log files older than seven days", "loops over the lines of a file and prints them numbered",
        "finds the ten most frequent words in a text file", "monitors the memory usage every five seconds",
        "creates a folder for every name listed in a file",
    ],
    "Write a C function that {task}.": [
        "reverses a string in place", "returns the length of a string without strlen",
        "swaps two integers with pointers",
        "finds the maximum value in an array", "counts the words in a string",
    ],
    "Write a Java method that {task}.": [
        "checks if a string is a palindrome", "returns the factorial of a number",
        "finds the largest element of an array",
        "reverses a linked list", "counts the vowels in a string",
    ],
}

# (template, topic table): every table is used by several phrasings, as real users ask the same thing
# many ways; the draft learns the target's answer style rather than one template's.
_CHAT_TEMPLATES = [
    ("Explain {x} in simple terms.", "concepts"),
    ("What is {x}? Keep it short.", "concepts"),
    ("Explain {x} in {n} sentences.", "concepts"),
    ("Summarize what {x} is for a ten-year-old.", "concepts"),
    ("Why does {x} matter?", "concepts"),
    ("What are the main differences between {x}?", "pairs"),
    ("Compare {x} in a few sentences.", "pairs"),
    ("Give me {n} tips for {x}.", "activities"),
    ("What are common mistakes people make when {x}?", "activities"),
    ("How can a beginner get better at {x}?", "activities"),
    ("How does {x} work?", "mechanisms"),
    ("Explain how {x} works, briefly.", "mechanisms"),
    ("What are the main parts of {x}?", "mechanisms"),
    ("Why {x}?", "whys"),
    ("Why {x}? Answer briefly.", "whys"),
    ("Write a short poem about {x}.", "poems"),
    ("Write a haiku about {x}.", "poems"),
    ("Describe {x} for a twelve-year-old.", "processes"),
    ("Explain {x}, step by step.", "processes"),
    ("List {n} {x}.", "lists"),
    ("Give me a list of {n} {x}, with one sentence each.", "lists"),
    ("What should I know before {x}?", "plans"),
    ("Make a short checklist for {x}.", "plans"),
]

_CHAT_TOPICS = {
    "concepts": [
        "a hash function", "a firewall", "an algorithm", "a spreadsheet", "the water table", "a food chain",
        "an ecosystem", "a galaxy", "gross domestic product", "interest rates", "a mortgage", "an index fund",
        "the law of supply", "a cell membrane", "an atom", "a chemical reaction", "friction", "momentum",
        "a light year", "the speed of sound", "a hurricane", "a tsunami", "the ozone layer", "a carbon footprint",
        "a virus in computing", "a cache", "a web browser", "a programming language", "a variable in programming",
        "a for loop", "a server", "an IP address", "bandwidth", "latency", "a password manager",
        "two-factor authentication", "the Roman Empire", "the French Revolution", "the printing press",
        "a constitution", "human rights", "mindfulness", "a habit", "procrastination", "critical thinking",
        "a hypothesis", "statistics", "an average", "a fraction", "a percentage", "geometry", "an equation",
        "a calorie", "protein", "a balanced diet", "sleep cycles", "stress", "an allergy", "antibiotics", "a gene",
        "a fossil", "a glacier", "erosion",
        "photosynthesis", "gravity", "inflation", "a black hole", "machine learning", "a neural network", "recursion",
        "democracy", "the stock market", "climate change", "evolution", "DNA", "the immune system", "electricity",
        "an API", "a database index", "object-oriented programming", "the internet", "blockchain", "compound interest",
        "supply and demand", "the greenhouse effect", "a compiler", "an operating system", "encryption",
        "cloud computing", "quantum computing", "the theory of relativity", "plate tectonics", "a linked list",
        "version control", "a recession", "opportunity cost", "entropy", "natural selection", "a budget",
        "the scientific method", "a vaccine", "cholesterol", "the placebo effect", "a sorting algorithm",
        "big O notation", "a function in mathematics", "probability", "a prime number", "renewable energy",
        "a credit score", "the Renaissance", "the Industrial Revolution", "a metaphor",
    ],
    "pairs": [
        "a laptop and a tablet", "renting and buying a home", "a debit card and a credit card", "weather and climate",
        "a crocodile and an alligator", "stocks and bonds", "Python and Java", "RAM and storage", "HTTP and HTTPS",
        "a list and a tuple in Python", "SQL and NoSQL databases", "frogs and toads", "baking and roasting",
        "a lake and a pond", "an apple and an orange", "a novel and a short story", "a republic and a monarchy",
        "a planet and a star", "a CPU and a GPU", "Wi-Fi and Bluetooth", "speed and velocity", "mass and weight",
        "a hurricane and a tornado", "butter and margarine", "coffee and tea", "running and walking",
        "a city and a town", "a loan and a grant", "email and instant messaging", "an app and a website",
        "Linux and Windows", "git and GitHub",
        "Python and JavaScript", "a list and a tuple in Python", "weather and climate", "stocks and bonds",
        "HTTP and HTTPS", "RAM and a hard drive", "a compiler and an interpreter", "mitosis and meiosis",
        "speed and velocity", "a crocodile and an alligator", "SQL and NoSQL databases", "a process and a thread",
        "frogs and toads", "debit cards and credit cards", "an LED and an incandescent bulb", "affect and effect",
        "a lake and a pond", "renting and buying a home", "git merge and git rebase", "a democracy and a monarchy",
        "classical and operant conditioning", "AC and DC current", "a latte and a cappuccino",
        "machine learning and deep learning", "a comet and an asteroid",
    ],
    "activities": [
        "studying for an exam", "public speaking", "saving money", "sleeping better", "learning a new language",
        "taking better photos", "writing a resume", "staying focused", "cooking pasta", "caring for houseplants",
        "running a meeting", "managing time", "learning math", "writing an essay", "painting a room", "baking bread",
        "staying safe online", "keeping a small garden", "teaching a child to read", "preparing for a job interview",
        "riding a bike in a city", "making new habits", "cleaning a laptop", "writing unit tests", "reading code",
        "learning a new language", "staying focused while studying", "saving money", "sleeping better",
        "public speaking", "writing clean code", "starting to run", "keeping a houseplant alive",
        "preparing for a job interview", "managing stress", "taking better photos with a phone",
        "cooking rice", "working from home", "reading more books", "learning to play the guitar",
        "making friends in a new city", "organizing a small kitchen", "debugging a program",
        "giving constructive feedback", "traveling on a budget", "drinking more water", "planning a birthday party",
        "keeping a journal", "learning to code", "reducing screen time", "writing a cover letter",
    ],
    "mechanisms": [
        "a smartphone", "a toaster", "a refrigerator", "a vacuum cleaner", "an electric car", "a jet engine",
        "a lock and key", "a clock", "a dishwasher", "a traffic light", "an air conditioner", "a hot air balloon",
        "a telescope", "a submarine", "a wind turbine", "the lungs", "the kidneys", "a keyboard", "a printer",
        "a speaker", "a microphone", "a barcode scanner", "a QR code", "a password hash", "a spam filter",
        "a microwave oven", "a car engine", "a vaccine", "GPS", "the human heart", "a solar panel", "a search engine",
        "a rainbow", "an airplane wing", "a battery", "Wi-Fi", "the stock exchange", "a thermostat", "a camera",
        "a touchscreen", "digestion", "a bicycle gear", "the electoral college", "a credit card payment",
        "a nuclear power plant", "noise-cancelling headphones", "a 3D printer", "the human eye", "an elevator",
        "a compass", "email", "a hybrid car", "photosynthesis in a leaf", "memory in the brain", "a washing machine",
    ],
    "whys": [
        "do we have fingerprints", "is the sea blue", "do we hiccup", "do dogs wag their tails",
        "does metal feel cold", "do we need vitamins", "does the wind blow", "do volcanoes erupt", "do we sneeze",
        "is sleep important for children", "do apples turn brown", "does bread rise", "do some people snore",
        "is reading good for you", "do computers need cooling", "do we age", "do bubbles pop", "is water wet",
        "do cars need oil", "do bridges have expansion joints",
        "do leaves change color in the fall", "do we need to sleep", "is the ocean salty", "do cats purr",
        "do we have seasons", "do onions make people cry", "is exercise good for the brain",
        "do planes leave white trails",
        "do stars twinkle", "is biodiversity important", "do we get goosebumps", "does ice float on water",
        "do birds migrate", "is the Dead Sea so salty", "do people yawn", "does bread go stale",
        "is it important to back up your files", "do programmers use version control", "does the moon have phases",
        "do we dream",
    ],
    "poems": [
        "a rainy morning", "a forgotten key", "the city at dawn", "a red balloon", "an old oak tree", "a river",
        "a bicycle ride", "the desert", "a snowy owl", "a birthday", "a quiet evening", "a thunderstorm",
        "the first day of school", "a busy market", "an empty beach",
        "the ocean at night", "a cup of coffee", "the first snow of winter", "a city in the rain", "an old friend",
        "the stars", "a lighthouse", "spring flowers", "a sleepy cat", "the mountains", "a summer storm",
        "learning to code", "a train journey", "the moon", "a garden", "the sea breeze", "a quiet library",
    ],
    "processes": [
        "how bread is made", "how paper is recycled", "how a bill becomes a law in Canada",
        "how a baby bird learns to fly", "how snow forms", "how a seed becomes a tree", "how glass is made",
        "how chocolate is made", "how a letter travels through the mail", "how a star is born", "how wounds heal",
        "how a mountain forms", "how cheese is made", "how a web page loads", "how water gets to a tap",
        "how an election works",
        "how plants grow from seeds", "how the heart pumps blood", "how a volcano erupts", "how bees make honey",
        "how a rainbow forms", "how the internet sends a message", "how the moon affects the tides",
        "how a caterpillar becomes a butterfly", "how money is printed", "how an earthquake happens",
        "how a computer stores information", "how recycling works", "how the seasons change", "how a cloud forms",
        "how the digestive system works", "how electricity gets to a house", "how a bridge stays up",
    ],
    "lists": [
        "ways to relax after work", "fruits that are high in vitamin C", "tips for a long flight",
        "classic novels worth reading", "ways to make a small room look bigger", "skills every programmer needs",
        "healthy snacks for kids", "ways to stay warm in winter", "inventions that changed the world",
        "ways to practice gratitude", "animals that live in the desert", "things to check before a road trip",
        "habits of good students", "ways to learn from mistakes", "indoor exercises", "questions for a first meeting",
        "ideas for a rainy day", "benefits of regular exercise", "ways to reduce plastic waste",
        "good habits for programmers", "easy dinner recipes", "fun facts about space", "ways to be more productive",
        "common mistakes in job interviews", "board games for families", "things to do in a new city",
        "ways to learn Python faster", "signs of dehydration", "uses of baking soda",
        "famous scientists and their discoveries",
        "ways to save energy at home", "questions to ask a doctor", "reasons to learn history", "low-cost hobbies",
        "features of a good password", "ways to improve your handwriting",
    ],
    "plans": [
        "learning to drive", "starting university", "getting a cat", "painting my house", "starting a blog",
        "going on a first job interview", "taking a gap year", "planting a tree", "buying a bicycle",
        "learning to cook", "starting to meditate", "hosting a dinner party",
        "adopting a dog", "starting a vegetable garden", "buying a used car", "moving to another country",
        "running a marathon", "starting a small business", "learning to swim as an adult", "going camping",
        "buying my first laptop", "starting a podcast", "renting an apartment", "traveling to Japan",
    ],
}

_COUNTS = ["three", "four", "five"]


def code_prompts() -> list[tuple[str, str]]:
    """(task, prompt) pairs of coding requests: every task in several phrasings."""
    pairs = [(t, p.format(task=t)) for p in _CODE_PHRASINGS for t in PYTHON_TASKS]
    pairs += [(n, p.format(name=n, methods=m)) for p in _CLASS_PHRASINGS for n, m in PYTHON_CLASSES]
    pairs += [(p + t, p.format(task=t)) for p, tasks in _OTHER_CODE.items() for t in tasks]
    pairs += [(t, p.format(task=t)) for i, t in enumerate(stdlib_tasks()) for p in _CODE_PHRASINGS[i % 2 :: 2]]
    return pairs


_DOC_VERBS = ("Return", "Convert", "Compute", "Calculate", "Check", "Find", "Split", "Remove", "Create", "Make",
              "Read", "Write", "Parse", "Format", "Encode", "Decode", "Count", "Join", "Replace", "Normalize",
              "Strip", "Escape", "Quote", "Generate", "Build", "Sort", "Merge", "Validate", "Extract")
_DOC_SKIP = {"test", "idlelib", "tkinter", "lib2to3", "turtledemo", "ensurepip", "site-packages", "dist-packages"}


@functools.lru_cache(maxsize=4)
def stdlib_tasks(limit: int = 1500) -> tuple[str, ...]:
    """Coding tasks read off the installed standard library: public functions and methods whose docstring
    starts "Return ...", "Convert ..." and so on become "returns ...", "converts ...".

    Offline, always present, and far wider than any hand-written table (about a thousand tasks on 3.11).
    Sorted, so the list only changes with the Python version (the teacher cache is keyed by the prompts).
    """
    import ast
    import re
    import sys
    from pathlib import Path

    stdlib = Path(sys.modules["os"].__file__).parent
    pattern = re.compile(rf"^({'|'.join(_DOC_VERBS)})s? ([A-Za-z][^`{{}}<>]{{12,110}})\.$")
    tasks = set()
    for path in sorted(stdlib.rglob("*.py")):
        if _DOC_SKIP & set(path.relative_to(stdlib).parts[:-1]) or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0].strip()
            match = pattern.match(doc)
            if match:
                tasks.add(f"{_third_person(match.group(1).lower())} {match.group(2)}")
    return tuple(sorted(tasks)[:limit])


def _third_person(verb: str) -> str:
    if verb.endswith("y"):
        return verb[:-1] + "ies"
    return verb + ("es" if verb.endswith(("ch", "sh", "s", "x")) else "s")


def chat_prompts() -> list[tuple[str, str]]:
    """(topic, prompt) pairs of chat requests."""
    pairs = []
    for i, (template, topic) in enumerate(_CHAT_TEMPLATES):
        for j, x in enumerate(_CHAT_TOPICS[topic]):
            pairs.append((x, template.format(x=x, n=_COUNTS[(i + j) % len(_COUNTS)])))
    return pairs


def training_prompts(seed: int = 0, code_share: float = 0.55) -> list[dict]:
    """All prompts as {"kind": "code"|"chat", "prompt": str}, in the order they should be answered.

    Within each kind, one prompt per distinct task comes before any rephrasing of a task already seen,
    so a time budget that answers only the first few hundred prompts still gets the widest spread; the
    kinds are interleaved so that every prefix holds about `code_share` code prompts.
    """
    rng = random.Random(seed)
    queues = {"code": _distinct_first(code_prompts(), rng), "chat": _distinct_first(chat_prompts(), rng)}
    out: list[dict] = []
    taken = {"code": 0, "chat": 0}
    while any(taken[k] < len(q) for k, q in queues.items()):
        behind_on_code = taken["code"] < code_share * (len(out) + 1)
        kind = "code" if (behind_on_code or taken["chat"] >= len(queues["chat"])) else "chat"
        if taken[kind] >= len(queues[kind]):
            kind = "chat" if kind == "code" else "code"
        out.append({"kind": kind, "prompt": queues[kind][taken[kind]]})
        taken[kind] += 1
    return out


def _distinct_first(pairs: list[tuple[str, str]], rng: random.Random) -> list[str]:
    """Shuffle, then order by how many times the task was already seen (first occurrences first)."""
    shuffled = pairs[:]
    rng.shuffle(shuffled)
    seen: dict[str, int] = {}
    ranked = []
    for index, (task, prompt) in enumerate(shuffled):
        ranked.append((seen.get(task, 0), index, prompt))
        seen[task] = seen.get(task, 0) + 1
    return [prompt for _, _, prompt in sorted(ranked)]
