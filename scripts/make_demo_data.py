"""Generate the synthetic ReDSM5-format demo data in data/demo/.

    python scripts/make_demo_data.py [--output-dir DIR]

The real ReDSM5 corpus is gated, so the demo trains on posts assembled from the template banks
below. Everything is drawn from one random.Random(SEED): a run writes byte-identical files.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from statistics import NormalDist

from hpo.data.redsm5 import ANNOTATIONS_FILE, POSTS_FILE, SYMPTOMS

SEED = 20240611
N_POSTS = 600
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "data" / "demo"
# Positive posts per label: the real rates (per 1,484 posts) scaled to 600, with the rare
# labels raised to 45 so a 15% validation split still holds a handful of positives each.
REAL_COUNTS = {
    "DEPRESSED_MOOD": 328, "ANHEDONIA": 124, "APPETITE_CHANGE": 44, "SLEEP_ISSUES": 102,
    "PSYCHOMOTOR": 35, "FATIGUE": 124, "WORTHLESSNESS": 311, "COGNITIVE_ISSUES": 59,
    "SUICIDAL_THOUGHTS": 165, "SPECIAL_CASE": 92,
}  # fmt: skip
MIN_POSITIVES = 45
TARGET_COUNTS = {
    label: max(MIN_POSITIVES, round(count * N_POSTS / 1484)) for label, count in REAL_COUNTS.items()
}
# Word counts: a lognormal body plus a small lognormal tail of long rants, since a single
# lognormal with median 20 and mean 30 almost never reaches the ~1,000-word posts Reddit has.
BODY_MEDIAN, BODY_SIGMA = 20.0, 0.7
TAIL_SHARE, TAIL_MEDIAN, TAIL_SIGMA = 0.04, 160.0, 0.9
MAX_WORDS = 1000
SHORT_POST_WORDS = 8  # below this, a post without evidence is one short line
EARLY_WORDS = 25  # evidence mostly starts within the first 25 words: inside 64 tokens
P_EARLY = 0.85
P_TWO_EVIDENCE = 0.35
P_VAGUE = 0.05
P_DISTRACTOR = 0.3
P_PARAGRAPH = 0.12

SLOTS: dict[str, tuple[str, ...]] = {
    "place": ("the grocery store", "the gym", "my cousin's place", "the library", "the park",
              "work", "the dentist", "the mall", "the beach", "the farmers market",
              "the hardware store", "the post office"),
    "person": ("my sister", "my brother", "my roommate", "my mom", "my dad", "a coworker",
               "my best friend", "my neighbor", "my partner", "my grandma", "my boss"),
    "day": ("yesterday", "last weekend", "on Tuesday", "this morning", "a few days ago",
            "last night", "over the holidays", "on Friday"),
    "thing": ("my laptop", "the car", "my phone", "the washing machine", "my bike", "the heater",
              "the kitchen sink", "my headphones"),
    "hobby": ("painting", "playing guitar", "hiking", "gaming", "reading fantasy novels",
              "baking bread", "photography", "playing soccer", "knitting", "drawing"),
    "show": ("that new detective series", "a documentary about octopuses", "the football game",
             "an old sitcom", "a cooking competition", "a video about space"),
    "city": ("Chicago", "Lisbon", "Toronto", "Manchester", "Denver", "Melbourne", "Dublin"),
    "number": ("two", "three", "four", "five", "six"),
    "pet": ("dog", "cat", "rabbit", "parrot", "hamster"),
    "subject": ("statistics", "history", "chemistry", "accounting", "Spanish", "biology"),
    "when": ("lately", "for weeks now", "these days", "for the past month", "since the new year",
             "for months", "most days", "all the time"),
    "weight": ("ten pounds", "five kilos", "almost twenty pounds", "a lot of weight"),
    "hours": ("twelve", "fourteen", "fifteen"),
}  # fmt: skip

FILLER = (
    "I went to {place} with {person} {day}.",
    "So {day} I finally fixed {thing} after watching a tutorial.",
    "The weather here in {city} has been all over the place.",
    "I've been getting into {hobby} with {person}.",
    "We watched {show} and talked about it for like an hour.",
    "I moved to {city} about {number} years ago for a job.",
    "Anyway, my {pet} knocked over a plant {day}.",
    "There was a long line at {place} so I just left.",
    "Not sure if this is the right subreddit for this.", "Sorry for the long post, I'm on mobile.",
    "I have {number} siblings and we're spread all over the country.",
    "The bus was late again {day}.", "I usually call {person} on Sundays.",
    "We had a small birthday thing for {person} {day}.", "Rent went up again this year.",
    "I'm taking a class on {subject} this semester.",
    "My car needs new tires and I keep putting it off.", "It rained the whole weekend—typical.",
    "Work has been busy because of a big project.", "I drove {person} to {place} {day}.",
    "English isn't my first language, so sorry for any mistakes.",
    "I don't really post here much, mostly just read.",
    "The neighbors are renovating and it's loud all day.",
    "My apartment is small but it's close to {place}.",
    "I graduated {number} years ago and have been working since.",
    "We adopted a {pet} last year from a shelter.",
    "I had a long meeting with {person} about the budget.",
    "A friend recommended {show} so I might start it.",
    "There's a festival in {city} next month that I might go to.",
    "I've been trying to save money for a trip to {city}.",
    "My {pet} is doing well, thanks for asking.", "I switched phone plans to save a little money.",
    "The café near {place} changed owners recently.", "My manager asked me to cover a shift {day}.",
    "For context, {person} and I share the rent.", "I bought a secondhand desk for my room {day}.",
    "{person} says I should post here, so here I am.", "My {subject} exam is in {number} weeks.",
    "We’re thinking about repainting the living room.", "I took {thing} in for repairs {day}.",
)  # fmt: skip
SHORT = ("Any advice?", "Just venting.", "Thanks for reading.", "Help please.", "Same here.",
         "Does anyone relate?", "Need to talk.", "Update: nothing changed.")  # fmt: skip

EVIDENCE: dict[str, tuple[str, ...]] = {
    "DEPRESSED_MOOD": (
        "I feel so empty inside {when}.", "I've been crying every night {when}.",
        "Everything feels hopeless and I can't shake this sadness.",
        "I'm so sad all the time and I don't even know why.",
        "There's a heavy darkness over me that never lifts.",
        "I cry in the shower so nobody hears me.", "I feel numb and miserable most of the day.",
        "My mood has been really low {when}.", "I just feel down and hopeless about everything.",
        "I broke down crying at {place} {day}.", "Every day feels gray and heavy.",
        "I've been depressed {when} and it keeps getting worse.",
    ),
    "ANHEDONIA": (
        "I used to love {hobby} but now I don't care about it at all.",
        "Nothing interests me anymore.", "I don't enjoy anything I used to enjoy.",
        "Even {hobby} feels pointless now.", "I stopped {hobby} because it gives me nothing.",
        "Hanging out with {person} used to be fun but now I feel nothing.",
        "I can't remember the last time I actually enjoyed something.",
        "My hobbies just feel like chores {when}.", "I've lost interest in pretty much everything.",
        "Music, friends, games, none of it brings me any joy now.",
        "I don't look forward to anything anymore.", "I have zero desire to do anything fun.",
    ),
    "APPETITE_CHANGE": (
        "I've barely eaten anything {when}.", "I lost {weight} because I have no appetite.",
        "I keep binge eating junk food late at night.",
        "I have no appetite at all and skip most meals.",
        "I've gained {weight} from stress eating {when}.",
        "Food tastes like nothing so I just don't eat.", "I forget to eat for whole days.",
        "I eat way too much just to feel something.", "My appetite is completely gone {when}.",
        "My clothes don't fit anymore because I lost so much weight.",
        "I've been overeating every evening and I can't stop.",
        "Some days I only eat one meal because I'm never hungry.",
    ),
    "SLEEP_ISSUES": (
        "I can't sleep at night {when}.", "I'm up until 4am every night staring at the ceiling.",
        "My insomnia is getting worse.", "I sleep {hours} hours a day and still want more.",
        "I wake up at 3am and can't fall back asleep.",
        "I've been sleeping through my alarms and most of the day.",
        "I lie in bed for hours but sleep never comes.",
        "I haven't had a full night's sleep {when}.", "My sleep schedule is completely wrecked.",
        "I nap all afternoon and then I'm awake all night.",
        "I took sleeping pills but I still can't sleep.", "Some nights I don't sleep at all.",
    ),
    "PSYCHOMOTOR": (
        "I can't sit still and keep pacing around my room.",
        "I feel like I'm moving in slow motion.", "My body feels so slow, even walking drags.",
        "I'm constantly restless and fidgeting {when}.", "People tell me I talk really slowly now.",
        "I keep tapping my leg and can't stay in one place.",
        "I feel agitated and jittery all the time.",
        "Every movement feels sluggish, like I'm underwater.",
        "I pace the kitchen for hours because I can't settle.",
        "My coworkers noticed I've been moving and speaking slower.",
        "I get so restless that I keep getting up and walking around.",
        "My hands won't stop fidgeting and my legs won't stop bouncing.",
    ),
    "FATIGUE": (
        "I'm exhausted all the time {when}.", "I have no energy to do anything.",
        "Even taking a shower wipes me out.", "I feel drained no matter how much I rest.",
        "I'm so tired that simple chores feel impossible.", "By noon I'm completely worn out.",
        "I don't have the energy to cook or clean anymore.",
        "Getting through a workday leaves me totally drained.",
        "I'm constantly fatigued and it's not getting better.",
        "I feel physically exhausted even after doing nothing.",
        "Brushing my teeth feels like running a marathon.",
        "I run out of energy before the day even starts.",
    ),
    "WORTHLESSNESS": (
        "I feel completely worthless.", "I'm a burden to everyone around me.",
        "I hate myself so much.", "Everything is my fault and I ruin everything.",
        "I feel so guilty about everything I've done.", "I'm useless and can't do anything right.",
        "I'm a failure and I always let {person} down.", "I feel like a waste of space.",
        "I don't deserve the people in my life.", "No matter what I do, I'm never good enough.",
        "I feel like such a disappointment to my family.", "I'm pathetic and I know it.",
    ),
    "COGNITIVE_ISSUES": (
        "I can't focus on anything {when}.",
        "I read the same page {number} times and nothing sticks.", "My brain feels foggy all day.",
        "I can't make even simple decisions anymore.", "I keep forgetting things at work.",
        "I can't concentrate long enough to finish a task.",
        "My mind goes blank when people ask me questions.",
        "I struggle to follow conversations now.",
        "I'm so indecisive that choosing lunch takes forever.",
        "My memory has been terrible {when}.", "I zone out in the middle of {subject} class.",
        "I can't think clearly anymore.",
    ),
    "SUICIDAL_THOUGHTS": (
        "I keep thinking about killing myself.", "I don't want to be alive anymore.",
        "Sometimes I wish I could just disappear forever.",
        "I've been having suicidal thoughts {when}.", "I wrote a goodbye note last week.",
        "I think everyone would be better off if I were dead.", "I looked up ways to end my life.",
        "I wish I could go to sleep and never wake up.",
        "I've thought about ending it all more than once.",
        "I don't see the point of living anymore.", "Death feels like the only way out.",
        "I attempted suicide last year and the thoughts are back.",
    ),
    "SPECIAL_CASE": (
        "My panic attacks are so bad I can't leave the house.",
        "I've been drinking every night to numb everything.",
        "I still have flashbacks from the accident.", "I cut myself again {day}.",
        "My anxiety is through the roof and my heart races constantly.",
        "I've been smoking weed all day just to cope.",
        "I hear voices that other people say aren't there.",
        "My OCD rituals take up hours of my day.",
        "I had a manic episode and spent all my savings.",
        "I get so anxious before work that I throw up.", "My therapist thinks I might have PTSD.",
        "I can't stop gambling even when I'm broke.",
    ),
}  # fmt: skip
# Shared by all labels on purpose: these carry no symptom-specific vocabulary (label noise).
VAGUE = (
    "I don't know what's wrong with me.", "Things have just been off {when}.",
    "It's been a really rough few months.", "I just don't feel like myself anymore.",
    "Everything is kind of a mess right now.", "I'm not doing great, honestly.",
    "It's hard to explain how I feel.", "Life has been a lot {when}.",
)  # fmt: skip
# Status-0 rows: symptom vocabulary that is negated or benign; the post does not get the label.
DISTRACTORS: dict[str, tuple[str, ...]] = {
    "DEPRESSED_MOOD": ("I cried at the end of {show} but it was a happy ending.",
                       "The movie was really sad but I loved it.",
                       "I felt a little down after losing the game but got over it quickly."),
    "ANHEDONIA": ("I still love {hobby} and do it every weekend.",
                  "I lost interest in {show} after a while, it got boring.",
                  "I'm really enjoying {hobby} lately."),
    "APPETITE_CHANGE": ("I ate a huge lunch {day} and it was great.",
                        "My appetite is normal, I eat three meals a day.",
                        "I lost a few pounds since I started cycling to work."),
    "SLEEP_ISSUES": ("I slept great last night.", "I stayed up until 4am once for a concert.",
                     "My sleep has been fine since I got a new mattress.",
                     "The baby woke us up at 3am but went right back to sleep."),
    "PSYCHOMOTOR": ("I was pacing around the airport waiting for my flight.",
                    "I couldn't sit still at the concert because the music was so good.",
                    "The internet has been moving in slow motion all week."),
    "FATIGUE": ("I was tired after the long hike but it was worth it.",
                "I'm exhausted from moving boxes all day, but in a good way.",
                "I had plenty of energy at the gym this morning."),
    "WORTHLESSNESS": ("I felt guilty for eating the last slice of cake, haha.",
                      "It was my fault we missed the bus, so I bought the coffee.",
                      "My old phone is worthless now."),
    "COGNITIVE_ISSUES": ("I forgot my umbrella at {place}.",
                         "I can't decide between two paint colors for the kitchen.",
                         "My memory is fine, I just lost my keys once."),
    "SUICIDAL_THOUGHTS": ("That exam killed me, but I passed.", "I'm dying to see how {show} ends.",
                          "My phone battery died on the way home."),
}  # fmt: skip
PHRASES = {
    "DEPRESSED_MOOD": "persistent sadness or low mood", "ANHEDONIA": "loss of interest or pleasure",
    "APPETITE_CHANGE": "a change in appetite or weight", "SLEEP_ISSUES": "disturbed sleep",
    "PSYCHOMOTOR": "restlessness or slowed movement", "FATIGUE": "fatigue or loss of energy",
    "WORTHLESSNESS": "worthlessness or excessive guilt",
    "COGNITIVE_ISSUES": "trouble concentrating or deciding",
    "SUICIDAL_THOUGHTS": "thoughts of death or suicide",
    "SPECIAL_CASE": "a clinically relevant problem outside the nine criteria",
}  # fmt: skip

VAGUE_NOTE = "Synthetic: vague wording,"
# (sentence, label, status, explanation); label is None for filler sentences.
Sentence = tuple[str, str | None, int, str]


class _Slots(dict):
    """format_map mapping that draws a fresh slot word for each placeholder."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def __missing__(self, key: str) -> str:
        return self.rng.choice(SLOTS[key])


def fill(rng: random.Random, template: str) -> str:
    text = template.format_map(_Slots(rng))
    return text[0].upper() + text[1:]


def word_targets(rng: random.Random) -> list[int]:
    """One word-count target per post, shuffled.

    Stratified lognormal quantiles rather than independent draws: with only ~24 tail posts,
    independent draws made the longest post swing between ~600 and ~1,500 words by seed.
    """
    n_tail = round(TAIL_SHARE * N_POSTS)
    quantiles = [
        median * math.exp(sigma * NormalDist().inv_cdf((i + 0.5) / n))
        for median, sigma, n in ((BODY_MEDIAN, BODY_SIGMA, N_POSTS - n_tail),
                                 (TAIL_MEDIAN, TAIL_SIGMA, n_tail))
        for i in range(n)
    ]  # fmt: skip
    targets = [min(MAX_WORDS, max(2, round(q))) for q in quantiles]
    rng.shuffle(targets)
    return targets


def evidence_sentences(rng: random.Random, labels: Sequence[str]) -> list[Sentence]:
    sentences: list[Sentence] = []
    for label in labels:
        for template in rng.sample(EVIDENCE[label], 2 if rng.random() < P_TWO_EVIDENCE else 1):
            if rng.random() < P_VAGUE:
                note = f"{VAGUE_NOTE} read in context as {PHRASES[label]}."
                sentences.append((fill(rng, rng.choice(VAGUE)), label, 1, note))
            else:
                note = f"Synthetic: the sentence describes {PHRASES[label]}."
                sentences.append((fill(rng, template), label, 1, note))
    if rng.random() < P_DISTRACTOR:
        label = rng.choice([symptom for symptom in SYMPTOMS if symptom not in labels])
        note = f"Synthetic: sounds like {PHRASES[label]} but is benign or negated, so absent."
        sentences.append((fill(rng, rng.choice(DISTRACTORS[label])), label, 0, note))
    return sentences


def make_post(rng: random.Random, labels: Sequence[str], target: int) -> list[Sentence]:
    """The post's sentences in order: filler up to the drawn length, evidence inserted early."""
    annotated = evidence_sentences(rng, labels)
    words = sum(len(sentence[0].split()) for sentence in annotated)
    if not annotated and target < SHORT_POST_WORDS:
        return [(rng.choice(SHORT), None, 0, "")]
    sentences: list[Sentence] = []
    while words < target:
        sentence = fill(rng, rng.choice(FILLER))
        sentences.append((sentence, None, 0, ""))
        words += len(sentence.split())
    for item in annotated:
        before, early = 0, [0]
        for index, sentence in enumerate(sentences, start=1):
            before += len(sentence[0].split())
            if before > EARLY_WORDS:
                break
            early.append(index)
        at = rng.choice(early) if rng.random() < P_EARLY else rng.randint(0, len(sentences))
        sentences.insert(at, item)
    return sentences


def generate() -> tuple[list[list[str]], list[list[str]]]:
    """(posts rows, annotations rows), without headers."""
    rng = random.Random(SEED)
    labels: list[list[str]] = [[] for _ in range(N_POSTS)]
    for label, count in TARGET_COUNTS.items():
        for index in rng.sample(range(N_POSTS), count):
            labels[index].append(label)
    posts, annotations = [], []
    for index, (post_labels, target) in enumerate(zip(labels, word_targets(rng), strict=True)):
        post_id = f"demo_{index + 1:04d}"
        sentences = make_post(rng, sorted(post_labels, key=list(TARGET_COUNTS).index), target)
        text = sentences[0][0]
        for sentence in sentences[1:]:
            text += ("\n\n" if rng.random() < P_PARAGRAPH else " ") + sentence[0]
        posts.append([post_id, text])
        for k, (sentence, label, status, note) in enumerate(sentences):
            if label is not None:
                annotations.append([post_id, f"{post_id}_{k}", sentence, label, str(status), note])
    return posts, annotations


def write_csv(path: Path, header: Sequence[str], rows: list[list[str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file, quoting=csv.QUOTE_MINIMAL, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


README = """\
# Demo data: SYNTHETIC ReDSM5-format posts

**Everything here is synthetic.** These are not Reddit posts and not ReDSM5 data, and no
clinician wrote or annotated them. `scripts/make_demo_data.py` assembles them from template
sentences so that the demo study trains offline on files in the official ReDSM5 format.

Regenerate byte-identically (fixed seed {seed}; needs the `hpo` package installed):
`python scripts/make_demo_data.py`

## How they were made

- {n} posts, `demo_0001` to `demo_{n:04d}`. Each label goes to a fixed number of posts drawn
  at random, independently per label: the real corpus's rates scaled to {n} posts, with the
  rare labels raised to {min_positives}.
- Length: each post gets a word-count target from stratified lognormal quantiles:
  {body:.0%} of posts with median {body_median:g} and sigma {body_sigma:g}, a long tail of
  {tail:.0%} with median {tail_median:g} and sigma {tail_sigma:g}, capped at {max_words}.
  Neutral filler sentences (a template bank with slot words) fill the target.
- Each label a post has adds 1 or 2 evidence sentences ({two:.0%} get 2) from a per-label
  bank, inserted at random but {early:.0%} of the time within the first ~{early_words} words,
  so that truncation to 128 tokens usually keeps them.
- Noise: {vague:.0%} of evidence sentences use vague wording shared by all labels, and
  {distractor:.0%} of posts get a status-0 row: a sentence with a symptom's vocabulary that is
  negated or benign ("I slept great last night."). A post has a label iff it has a status-1
  row for it.
- `sentence_id` is `{{post_id}}_{{k}}` (k = index of the sentence in the post);
  `sentence_text` is the sentence exactly as it appears in the post.

## Label counts (posts with a status-1 row)

| label | demo posts (of {n}) | real corpus (of 1,484) |
| --- | ---: | ---: |
{label_rows}

Annotation rows: {rows} ({status1} status 1, of which {vague_rows} vague; {status0} status 0).

## Post length (whitespace-separated words)

| min | median | mean | 90th pct | max | posts > 100 words | posts > 400 words |
| ---: | ---: | ---: | ---: | ---: | ---: | ---: |
| {w_min} | {w_median:g} | {w_mean:.1f} | {w_p90} | {w_max} | {over100} | {over400} |

The real corpus averages 294.7 words per post (min 2, max 6,990); the demo is shorter so that
most posts fit the demo's 128-token limit while the tail still gets truncated.
"""


def readme(posts: list[list[str]], annotations: list[list[str]]) -> str:
    positives = {label: {row[0] for row in annotations if row[3] == label and row[4] == "1"}
                 for label in TARGET_COUNTS}  # fmt: skip
    with_symptom = set().union(*(positives[label] for label in SYMPTOMS))
    label_rows = [f"| {label} | {len(positives[label])} | {REAL_COUNTS[label]} |"
                  for label in TARGET_COUNTS]  # fmt: skip
    label_rows.append(f"| none of the nine | {len(posts) - len(with_symptom)} | 392 |")
    status1 = sum(row[4] == "1" for row in annotations)
    words = sorted(len(text.split()) for _, text in posts)
    return README.format(
        seed=SEED, n=len(posts), min_positives=MIN_POSITIVES, body=1 - TAIL_SHARE,
        body_median=BODY_MEDIAN, body_sigma=BODY_SIGMA, tail=TAIL_SHARE, tail_median=TAIL_MEDIAN,
        tail_sigma=TAIL_SIGMA, max_words=MAX_WORDS, two=P_TWO_EVIDENCE, early=P_EARLY,
        early_words=EARLY_WORDS, vague=P_VAGUE, distractor=P_DISTRACTOR,
        label_rows="\n".join(label_rows), rows=len(annotations), status1=status1,
        vague_rows=sum(row[5].startswith(VAGUE_NOTE) for row in annotations),
        status0=len(annotations) - status1, w_min=words[0], w_median=statistics.median(words),
        w_mean=statistics.fmean(words), w_p90=words[int(0.9 * len(words))], w_max=words[-1],
        over100=sum(w > 100 for w in words), over400=sum(w > 400 for w in words),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT)
    output_dir: Path = parser.parse_args(argv).output_dir
    posts, annotations = generate()
    output_dir.mkdir(parents=True, exist_ok=True)
    write_csv(output_dir / POSTS_FILE, ("post_id", "text"), posts)
    header = ("post_id", "sentence_id", "sentence_text", "DSM5_symptom", "status", "explanation")
    write_csv(output_dir / ANNOTATIONS_FILE, header, annotations)
    (output_dir / "README.md").write_text(
        readme(posts, annotations), encoding="utf-8", newline="\n"
    )


if __name__ == "__main__":
    main()
