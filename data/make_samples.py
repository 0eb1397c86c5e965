"""Write the sample inputs of jobs/translate.yaml, jobs/summarize.yaml and jobs/dataset.yaml.

    python data/make_samples.py      # rewrites data/prompts/*.parquet (deterministic)

The rows are composed from hand-written business phrases with a fixed seed, so the files
are reproducible and every row is distinct.
"""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent / "prompts"

# --- translate: short business sentences ------------------------------------------------
_SUBJECTS = [
    "The quarterly review", "Our kickoff meeting", "The supplier audit", "The board call",
    "The product demo", "The budget workshop", "The customer visit", "The team offsite",
    "The contract signing", "The training session", "The hiring panel", "The release review",
]  # fmt: skip
_CHANGES = [
    "has been moved to", "is confirmed for", "will take place on", "was postponed to",
    "is now scheduled for", "has been brought forward to",
]  # fmt: skip
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
_TIMES = ["9 am", "10:30", "noon", "2 pm", "4 pm"]
_REQUESTS = [
    "Please send the signed invoice before the end of the month.",
    "Could you confirm the delivery address for order {n}?",
    "We have received your payment of {amount} euros, thank you.",
    "The shipment for order {n} left our warehouse this morning.",
    "Please find attached the updated price list for next year.",
    "Your account manager will call you back within two business days.",
    "We are sorry for the delay and will refund the shipping costs.",
    "The new office opens on the first of {month}.",
    "Remember to submit your expense reports by Friday.",
    "Our support line is closed on public holidays.",
    "The draft agreement needs approval from the legal team.",
    "Sales grew by {pct} percent compared with last quarter.",
    "Please update your password before the system migration.",
    "We would like to schedule a call to discuss the renewal.",
    "The warehouse will be closed for inventory on {day}.",
    "Thank you for your order; it will ship within {k} days.",
]
_MONTHS = ["March", "April", "June", "September", "October", "November"]
_LANGUAGES = ["French", "Spanish", "German", "Italian"]


def translate_rows(rng: random.Random, count: int) -> list[dict]:
    seen: set[str] = set()
    rows = []
    while len(rows) < count:
        if rng.random() < 0.4:
            text = (
                f"{rng.choice(_SUBJECTS)} {rng.choice(_CHANGES)} "
                f"{rng.choice(_DAYS)} at {rng.choice(_TIMES)}."
            )
        else:
            text = rng.choice(_REQUESTS).format(
                n=rng.randint(1000, 9999),
                amount=rng.randint(2, 90) * 50,
                month=rng.choice(_MONTHS),
                pct=rng.randint(2, 25),
                day=rng.choice(_DAYS),
                k=rng.randint(2, 7),
            )
        if text in seen:
            continue
        seen.add(text)
        rows.append(
            {
                "id": f"tr-{len(rows):04d}",
                "text": text,
                "target_language": _LANGUAGES[len(rows) % len(_LANGUAGES)],
            }
        )
    return rows


# --- summarize: short company documents --------------------------------------------------
_COMPANIES = ["Northwind", "Contoso", "Fabrikam", "Tailspin", "Litware", "Adatum", "Woodgrove"]
_DEPARTMENTS = ["finance", "sales", "operations", "customer support", "engineering", "HR"]
_KINDS = ["weekly update", "incident report", "meeting notes", "project status", "memo"]
_OPENERS = [
    "This {kind} covers the {dept} team at {company} for week {week}.",
    "{company} {dept} {kind}, week {week}.",
    "Summary of the {dept} {kind} circulated at {company} in week {week}.",
]
_FACTS = [
    "Revenue for the period reached {amount} thousand euros, {pct} percent above plan.",
    "Two senior engineers joined the team and onboarding is on track.",
    "A network outage on {day} stopped order processing for {hours} hours.",
    "The root cause was an expired certificate on the payment gateway.",
    "Customer satisfaction scores rose to {score} out of 10.",
    "The migration to the new billing system is {pct} percent complete.",
    "Travel spending was cut by {pct} percent after the new policy.",
    "The team closed {k} support tickets and reduced the backlog by a third.",
    "Legal approved the revised supplier contract with a two-year term.",
    "Hiring for the data analyst role is paused until next quarter.",
    "The warehouse in Lyon reported stock shortages for three product lines.",
    "A pilot with {k} customers will test the new self-service portal.",
]
_ACTIONS = [
    "Next step: finance will present a revised forecast on {day}.",
    "Action: renew all certificates and add monitoring before month end.",
    "Decision: the launch date stays fixed; marketing prepares the campaign.",
    "Owners will report progress at the next meeting on {day}.",
    "Open question: whether to extend the pilot to the German market.",
]


def summarize_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for i in range(count):
        fill = {
            "kind": rng.choice(_KINDS),
            "dept": rng.choice(_DEPARTMENTS),
            "company": rng.choice(_COMPANIES),
            "week": rng.randint(1, 52),
            "amount": rng.randint(120, 990),
            "pct": rng.randint(3, 40),
            "day": rng.choice(_DAYS),
            "hours": rng.randint(2, 9),
            "score": rng.randint(6, 9),
            "k": rng.randint(12, 240),
        }
        facts = rng.sample(_FACTS, k=rng.randint(3, 5))
        parts = [rng.choice(_OPENERS), *facts, rng.choice(_ACTIONS)]
        document = " ".join(p.format(**fill) for p in parts)
        title = f"{fill['company']} {fill['dept']} {fill['kind']} (week {fill['week']})"
        rows.append({"doc_id": f"doc-{i:04d}", "title": title, "document": document})
    return rows


# --- dataset: seed topics for synthetic Q&A pairs ----------------------------------------
_DOMAINS = {
    "accounting": ["accrual accounting", "depreciation", "cash flow statements", "VAT returns",
                   "invoice matching", "budget variance"],
    "logistics": ["last-mile delivery", "warehouse slotting", "customs clearance",
                  "safety stock", "freight consolidation", "returns handling"],
    "human resources": ["onboarding checklists", "performance reviews", "remote work policy",
                        "parental leave", "exit interviews", "skills matrices"],
    "it operations": ["password managers", "backup rotation", "incident postmortems",
                      "certificate renewal", "patch management", "access reviews"],
    "sales": ["pipeline forecasting", "discount approval", "account planning",
              "renewal negotiations", "lead qualification", "territory design"],
    "customer support": ["ticket triage", "service level agreements", "knowledge bases",
                         "escalation paths", "customer satisfaction surveys", "refund policy"],
    "legal": ["non-disclosure agreements", "data retention", "contract renewals",
              "GDPR requests", "supplier liability", "trademark use"],
}  # fmt: skip
_AUDIENCES = ["a new employee", "a team lead", "a small business owner", "a finance manager",
              "an intern", "a customer"]  # fmt: skip
_LEVELS = ["basic", "intermediate", "advanced"]


def dataset_rows(rng: random.Random, count: int) -> list[dict]:
    combos = [
        (domain, topic, audience)
        for domain, topics in _DOMAINS.items()
        for topic in topics
        for audience in _AUDIENCES
    ]
    rng.shuffle(combos)
    return [
        {
            "topic_id": f"topic-{i:04d}",
            "domain": domain,
            "topic": topic,
            "audience": audience,
            "level": _LEVELS[i % len(_LEVELS)],
        }
        for i, (domain, topic, audience) in enumerate(combos[:count])
    ]


def write(name: str, rows: list[dict]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    return path


def main() -> None:
    rng = random.Random(20240601)
    for name, rows in [
        ("translate", translate_rows(rng, 240)),
        ("summarize", summarize_rows(rng, 200)),
        ("dataset", dataset_rows(rng, 200)),
    ]:
        print(f"{write(name, rows)}: {len(rows)} rows")


if __name__ == "__main__":
    main()
