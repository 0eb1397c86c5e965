"""Write data/tasks/mixed_tasks.parquet: a labelled mixed-task prompt set (id, task, prompt).

Eight task types. Each prompt pairs one of several hand-written phrasings of the task's
instruction with one item of that task's own content pool, so prompts of one task share
neither a sentence nor a topic pattern: the clustering must find the task, not a template.
Deterministic (fixed seed); rerun it to regenerate the file byte for byte.

    python data/tasks/make_mixed_tasks.py [--out data/tasks/mixed_tasks.parquet]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PROMPTS_PER_TASK = 72
SEED = 20240605

TRANSLATE_TEMPLATES = [
    "Translate into French:\n{x}",
    "Please translate the following sentence to French: {x}",
    'How would you say this in French? "{x}"',
    "French translation needed: {x}",
    "Render this English text in natural French.\n\n{x}",
    "Can you put this into French for our Paris office? {x}",
    "Translate from English to French, keeping the tone formal:\n{x}",
    "Give me the French version of: {x}",
    "EN -> FR: {x}",
    "I need this line in French, please: {x}",
]
TRANSLATE_CONTENT = [
    "The meeting has been moved to Thursday at ten o'clock.",
    "Please send me the signed contract before the end of the week.",
    "Our quarterly revenue grew by twelve percent compared to last year.",
    "The train to Lyon is delayed by forty minutes.",
    "Could you book a table for four people tonight?",
    "The new warehouse opens in March and will employ two hundred people.",
    "I am sorry, but the product you ordered is out of stock.",
    "Thank you for your patience while we fix the login issue.",
    "The invoice is attached; payment is due within thirty days.",
    "My flight lands at Charles de Gaulle at seven in the morning.",
    "We would like to invite you to our annual customer conference.",
    "The museum is closed on Mondays and public holidays.",
    "Please remember to lock the door when you leave the office.",
    "The weather will be sunny with a light breeze in the afternoon.",
    "Our team will contact you within two business days.",
    "The hotel offers free breakfast and a shuttle to the airport.",
    "I would like to change my reservation to next Saturday.",
    "The board approved the budget for the new research lab.",
    "Where is the nearest pharmacy that is open on Sunday?",
    "The package was delivered to the wrong address yesterday.",
    "We are looking for an experienced accountant to join our team.",
    "The software update fixes several security vulnerabilities.",
    "My daughter starts primary school in September.",
    "The conference room on the third floor has a broken projector.",
    "Please confirm your attendance by replying to this email.",
    "The price includes shipping and a two-year warranty.",
    "Our store will be closed for inventory on the first of July.",
    "He has worked at the bank for more than fifteen years.",
    "The recipe calls for three eggs and a cup of flour.",
    "I left my umbrella on the bus this morning.",
    "The customer asked for a refund because the screen was cracked.",
    "We recommend arriving at the station at least twenty minutes early.",
    "The factory reduced its energy consumption by a third.",
    "Your subscription will renew automatically next month.",
    "The children played in the garden until it got dark.",
    "The lawyer will review the agreement on Tuesday afternoon.",
]

SUMMARIZE_TEMPLATES = [
    "Summarize the following text in two sentences:\n\n{x}",
    "Give me a short summary of this:\n{x}",
    "TL;DR please.\n\n{x}",
    "Write a one-paragraph summary of the passage below.\n\n{x}",
    "Condense this into three bullet points:\n{x}",
    "What are the key points of this report? Keep it brief.\n\n{x}",
    "Summarise for a busy executive:\n{x}",
    "Boil this down to a single sentence: {x}",
    "Read the following and provide a concise summary.\n---\n{x}",
]
SUMMARIZE_CONTENT = [
    "Northwind Logistics reported that late deliveries fell from nine to four percent after it rerouted trucks around the ring road. The change cost two new dispatchers but saved an estimated 300,000 euros in penalties. Managers plan to extend the scheme to the southern depots next spring.",
    "The city council met on Tuesday to discuss the proposed bike lanes on Main Street. Shop owners worried about losing parking, while cyclists cited a rise in accidents. The council voted to run a six-month trial and to publish traffic counts every month.",
    "A study of 2,000 office workers found that those who took short walking breaks reported less back pain and slightly higher productivity. The researchers caution that the results are self-reported and call for a controlled trial.",
    "Our help desk received 4,312 tickets in May, up eighteen percent. Password resets made up a third of them. Introducing self-service resets could free roughly one full-time agent, the support lead estimates.",
    "The new library wing opened after two years of construction. It adds a children's reading room, twelve study rooms and a maker space with 3D printers. Opening hours are extended until ten in the evening on weekdays.",
    "Sales of electric scooters doubled in the first quarter, driven by rental fleets in large cities. However, insurers report a sharp increase in claims, and two cities are considering speed limits for rented scooters.",
    "The company will move to a four-day week for a trial period of three months. Staff keep full pay, and managers will track output, customer satisfaction and sick days. A decision on making it permanent is due in October.",
    "Farmers in the valley are switching from maize to sorghum because of repeated summer droughts. Sorghum needs about a third less water, but local mills are not yet equipped to process it, so most of the harvest is shipped abroad.",
    "The internal audit found that twelve of forty suppliers had no signed data-protection agreement. Procurement has been asked to collect the missing agreements within sixty days and to block new orders from suppliers without one.",
    "After complaints about noise, the airport agreed to limit night flights to eight per night and to fund insulation for homes under the flight path. Residents' groups welcomed the deal but want independent noise monitoring.",
    "The hospital introduced a text-message reminder system for appointments. Missed appointments dropped from eleven to six percent in three months, freeing around 900 slots that were offered to patients on the waiting list.",
    "The software team migrated the billing service to a new database over a weekend. Downtime was ninety minutes instead of the planned four hours, and no data was lost, although two reports ran slowly on Monday.",
    "A heatwave pushed electricity demand to a record high on Wednesday. The grid operator asked large consumers to cut usage during the evening peak and imported power from neighbouring countries to avoid blackouts.",
    "The museum's new exhibition on medieval maps drew 40,000 visitors in its first month, twice the forecast. Because of the demand, the museum will add late openings on Fridays and extend the show until January.",
    "Customer surveys show that people like the new app design but find the checkout confusing. Forty percent of abandoned carts happen on the payment page. The product team will test a one-page checkout next sprint.",
    "The school district hired thirty new teachers to reduce class sizes in the first three grades. Average class size will fall from twenty-eight to twenty-two pupils. The cost is covered by a state grant for two years.",
    "A fire in the storage hall destroyed packaging material but no finished goods. Production stopped for two days. Insurance is expected to cover the damage, and the fire service recommended installing sprinklers in the hall.",
    "Researchers trained a model to detect crop disease from smartphone photos. In field tests it matched expert agronomists in eighty-seven percent of cases, and it works offline, which matters in areas with poor coverage.",
    "The bakery chain raised prices by five percent because flour and energy cost more. Sales volume fell slightly in the first week, but revenue rose overall. The chain plans a loyalty card to win back regular customers.",
    "The ferry operator cancelled all crossings on Saturday due to storm warnings. Passengers can rebook for free or get a full refund. Extra sailings are scheduled on Sunday and Monday to clear the backlog.",
    "An employee survey found that most staff want clearer career paths rather than higher bonuses. HR will publish skill matrices for each role and introduce twice-yearly development conversations.",
    "The regional bus company will replace sixty diesel buses with electric ones by 2027. Charging stations will be built at two depots. The project is funded partly by an EU grant covering forty percent of the cost.",
    "The quarterly review shows that the marketing campaign brought in 1,200 new leads but only forty paying customers. The team suspects the targeting was too broad and will narrow the campaign to mid-sized firms.",
    "Heavy rain flooded the underground car park of the shopping centre overnight. About thirty cars were damaged. The centre is closed until the water is pumped out and electricians have checked the installations.",
    "The startup raised eight million dollars to expand its recycling robots to three new countries. Its machines sort plastic waste by type with cameras and suction arms, and the company says they cut sorting costs by half.",
    "Volunteers planted 5,000 trees along the river over two weekends. The local environment group says the trees will reduce erosion and provide shade for fish. Another planting day is planned for the autumn.",
    "The finance department closed the year with a small surplus thanks to lower travel costs. The surplus will go into a reserve for IT upgrades. Travel budgets for next year stay at the reduced level.",
    "A new law requires landlords to register all short-term rentals with the city. Unregistered listings face fines of up to 10,000 euros. Platforms must remove listings that lack a registration number.",
    "The orchestra announced its season programme, featuring three world premieres and a cycle of Beethoven symphonies. Ticket prices stay unchanged, and students under twenty-five can attend dress rehearsals for free.",
    "Warehouse staff tested exoskeleton vests that support the back while lifting. Most testers reported less fatigue, though some found the vests hot in summer. The company will buy fifty vests for the busiest shifts.",
    "The government cut the subsidy for home solar panels by half, starting in January. Installers expect a rush of orders in December followed by a slowdown. Industry groups have asked for a gradual phase-out instead.",
    "The clinic extended its opening hours to Saturdays after patients asked for weekend appointments. The first two Saturdays were fully booked, mostly by working parents and shift workers.",
]

SQL_TEMPLATES = [
    "Write a SQL query for this request: {x}",
    "Given the table described, produce a SQL statement that answers: {x}",
    "SQL please. {x}",
    "I need a PostgreSQL query. {x}",
    "Convert this question into SQL: {x}",
    "Help me write the SELECT statement: {x}",
    "Write an SQL query (standard SQL, no vendor extensions). Task: {x}",
    "Can you give me the query to do the following in MySQL? {x}",
]
SQL_CONTENT = [
    "Table orders(id, customer_id, total, created_at). Find the total revenue per month in 2023.",
    "Table employees(id, name, department, salary). List the three highest-paid employees in each department.",
    "Tables customers(id, name, country) and orders(id, customer_id, total). Show customers who have never placed an order.",
    "Table products(id, name, price, category). Count the products in each category with a price above 50.",
    "Table logins(user_id, login_time). Find users who logged in on at least five different days last week.",
    "Table invoices(id, client_id, amount, paid). Return the total unpaid amount per client, largest first.",
    "Tables students(id, name) and grades(student_id, course, score). Get each student's average score, only for students with more than three grades.",
    "Table flights(id, origin, destination, departure, arrival). Find the average flight duration for each route.",
    "Table page_views(session_id, url, viewed_at). Find the ten most visited URLs yesterday.",
    "Table inventory(sku, warehouse, quantity). List SKUs whose total quantity across warehouses is below 20.",
    "Tables authors(id, name) and books(id, author_id, year). Find authors who published books in both 2019 and 2021.",
    "Table transactions(id, account_id, amount, ts). Compute a running balance per account ordered by time.",
    "Table sensors(device_id, reading, recorded_at). Get the latest reading for every device.",
    "Table users(id, email, signup_date). Find duplicate email addresses and how often each appears.",
    "Tables orders(id, product_id, qty) and products(id, name). Which product sold the most units?",
    "Table tickets(id, status, opened_at, closed_at). Calculate the median resolution time of closed tickets.",
    "Table employees(id, name, manager_id). List every employee together with the name of their manager.",
    "Table rentals(id, car_id, start_date, end_date). Find cars that were never rented in June.",
    "Table sales(region, year, amount). Show the year-over-year growth in sales for each region.",
    "Table comments(id, post_id, created_at). Find posts with no comments in the last thirty days.",
    "Table payments(id, method, amount). What share of the total amount was paid by card?",
    "Tables patients(id, name) and visits(patient_id, visit_date). Find patients who visited more than twice in one month.",
    "Table subscriptions(user_id, plan, started_at, cancelled_at). Count active subscriptions per plan today.",
    "Table shipments(id, carrier, shipped_at, delivered_at). Which carrier has the lowest average delivery time?",
    "Table reviews(product_id, rating). Rank products by average rating, requiring at least ten reviews.",
    "Table attendance(student_id, date, present). Find students with an attendance rate below eighty percent.",
    "Table events(user_id, event_type, ts). For each user, find the time between their first and last event.",
    "Table salaries(employee_id, year, salary). Find employees whose salary decreased from one year to the next.",
    "Tables courses(id, title) and enrollments(course_id, student_id). List courses with fewer than five students.",
    "Table weather(city, day, temperature). Find the hottest day for each city.",
    "Table orders(id, status). Delete all orders with status 'cancelled' that are older than a year.",
    "Table accounts(id, balance). Increase the balance of every account by two percent interest.",
    "Create a table called projects with an id primary key, a name, a start date and a budget.",
    "Table stock_prices(symbol, day, close). Compute a seven-day moving average of the closing price per symbol.",
]

SENTIMENT_TEMPLATES = [
    "Classify the sentiment of this review as positive, negative or neutral:\n{x}",
    'Is the following customer review positive or negative?\n"{x}"',
    "Sentiment analysis: {x}\nAnswer with one word.",
    "What is the tone of this feedback - happy, unhappy, or mixed? {x}",
    "Label this review's sentiment (positive / negative / neutral): {x}",
    "Would you say the writer of this comment liked the product? {x}",
    "Rate the sentiment from 1 (very negative) to 5 (very positive): {x}",
    "Decide whether this tweet expresses a positive or a negative opinion: {x}",
]
SENTIMENT_CONTENT = [
    "The battery lasts all day and the screen is gorgeous. Best phone I've owned.",
    "Arrived broken and customer service never answered my emails.",
    "The food was okay, nothing special, but the waiter was friendly.",
    "Absolutely loved the hotel, the staff went out of their way to help us.",
    "Terrible fit, the shoes are two sizes too small. Returning them.",
    "Works as described. Setup took five minutes.",
    "I waited an hour for a cold pizza. Never again.",
    "This blender is a beast, crushes ice like nothing.",
    "The movie started slow but the ending blew me away.",
    "Overpriced for what you get, the fabric feels cheap.",
    "My kids adore this game, we play it every weekend.",
    "Delivery was fast but the box was dented.",
    "The app crashes every time I try to upload a photo. Useless.",
    "Great value for money, I'd buy it again.",
    "The concert sound was muddy and we couldn't hear the vocals.",
    "Comfortable chair, my back pain is gone after a week.",
    "The instructions were confusing, but it works fine now.",
    "Rude receptionist and a dirty room. Avoid this place.",
    "Fantastic coffee and a cozy atmosphere, my new favourite spot.",
    "It does the job. Not great, not bad.",
    "The headphones stopped working after two weeks.",
    "Such a thoughtful gift, my mother was thrilled.",
    "Check-in took forever and the pool was closed.",
    "Crisp photos even at night, really impressed with this camera.",
    "The book was boring and far too long.",
    "Five stars, the plumber was on time and fixed everything.",
    "The course content was outdated and the videos kept buffering.",
    "Smells amazing and lasts all day, I get compliments constantly.",
    "Meh. The sequel is worse than the original.",
    "Our flight was cancelled with no explanation and no refund so far.",
    "The vacuum is quiet and picks up all the dog hair.",
    "Portions were tiny and the bill was huge.",
    "Solid laptop for the price, though the speakers are weak.",
    "I regret this purchase, the colour looks nothing like the picture.",
    "Lovely staff, clean rooms, and a view to die for.",
    "The update made the app slower and removed features I used daily.",
]

ENTITIES_TEMPLATES = [
    "Extract all named entities from the text below and return them as JSON with keys person, organization, location:\n{x}",
    "Return a JSON object listing the people, companies and places mentioned in: {x}",
    "Named entity recognition. Output JSON only.\nText: {x}",
    'Pull out every person, organisation and location from this sentence as a JSON list of {{"text", "type"}} objects: {x}',
    "Identify the entities (PER, ORG, LOC, DATE) in the following and answer in JSON: {x}",
    "From this news snippet, extract entities into JSON: {x}",
    "Parse the text and give me a JSON array of the named entities with their types. {x}",
    "JSON output required. Which people, organizations and locations appear here? {x}",
]
ENTITIES_CONTENT = [
    "Angela Merkel met Emmanuel Macron in Berlin on Monday to discuss energy policy.",
    "Apple opened a new research centre in Munich, said CEO Tim Cook.",
    "Maria Lopez joined Siemens as head of its Madrid office in 2021.",
    "The World Health Organization warned of a measles outbreak in Lagos.",
    "Toyota and Panasonic will build a battery plant near Osaka.",
    "Novelist Haruki Murakami will speak at the Edinburgh Book Festival in August.",
    "Lionel Messi signed with Inter Miami after leaving Paris Saint-Germain.",
    "The European Central Bank in Frankfurt raised interest rates, Christine Lagarde announced.",
    "Dr. Ahmed Khan of Johns Hopkins University presented the results in Boston.",
    "Spotify hired former Netflix executive Laura Chen to lead its podcast unit in Stockholm.",
    "NASA and the European Space Agency launched the probe from French Guiana.",
    "Mayor Sadiq Khan opened the new Elizabeth line station in east London.",
    "Samsung Electronics reported record profits at its headquarters in Suwon.",
    "Greta Thunberg addressed the United Nations climate summit in New York.",
    "Volkswagen will cut 2,000 jobs at its Wolfsburg plant, union leader Daniela Cavallo said.",
    "Professor Jane Goodall visited Gombe Stream National Park in Tanzania last spring.",
    "Microsoft acquired the gaming studio Activision Blizzard based in Santa Monica.",
    "The Louvre in Paris lent three paintings to the Metropolitan Museum of Art.",
    "Elon Musk said Tesla would open a factory outside Mexico City.",
    "Chef Massimo Bottura opened a soup kitchen in Rio de Janeiro with the Red Cross.",
    "The Bank of Japan kept rates unchanged, Governor Kazuo Ueda told reporters in Tokyo.",
    "Airbus delivered its first A321XLR to Iberia at the Hamburg plant.",
    "Serena Williams invested in a Nairobi startup called Twiga Foods.",
    "The Red Cross sent aid workers to Aleppo after the earthquake in Syria.",
    "Jacinda Ardern will teach at Harvard Kennedy School in Cambridge, Massachusetts.",
    "IKEA is opening its first store in Bogota, Colombia, next year.",
    "The FBI arrested a suspect in Chicago, spokesperson Mark Davis confirmed.",
    "Pope Francis travelled to Lisbon for World Youth Day.",
    "Nestle moved its research team from Vevey to Lausanne in Switzerland.",
    "Astronaut Samantha Cristoforetti returned to Cologne after her mission with the European Space Agency.",
    "Shell sold its Nigerian onshore assets to a group led by Tony Elumelu.",
    "Taylor Swift performed three nights at Wembley Stadium in London.",
    "The University of Cape Town appointed Mamokgethi Phakeng as vice-chancellor.",
    "Google DeepMind opened an office in Zurich led by researcher Pushmeet Kohli.",
    "Indian Prime Minister Narendra Modi met Joe Biden at the White House.",
]

POEM_TEMPLATES = [
    "Write a short poem about {x}.",
    "Compose a haiku about {x}.",
    "Write a four-line rhyming poem on the theme of {x}.",
    "Could you write me a sonnet about {x}?",
    "Write a free-verse poem, melancholic in tone, about {x}.",
    "I'd love a limerick about {x}.",
    "Pen a few lines of poetry celebrating {x}.",
    "Write a poem for a child about {x}, with simple words and rhymes.",
    "Give me a short, vivid poem inspired by {x}.",
]
POEM_CONTENT = [
    "the first snow of winter",
    "an old lighthouse keeper",
    "the smell of rain on hot pavement",
    "a cat sleeping in the sun",
    "leaving home for the first time",
    "the night shift at a hospital",
    "autumn leaves in a city park",
    "the sea at dawn",
    "a grandmother's kitchen",
    "the last train home",
    "bees in a lavender field",
    "a forgotten violin",
    "the silence after a storm",
    "learning to ride a bicycle",
    "a city at midnight",
    "the moon over the desert",
    "an abandoned railway station",
    "friendship that lasts decades",
    "the first cup of coffee in the morning",
    "a mountain hidden in fog",
    "the end of summer holidays",
    "a letter that was never sent",
    "fireflies in July",
    "a lonely robot on Mars",
    "the sound of a distant church bell",
    "a river that runs through a small town",
    "the courage of a small seed",
    "a library after closing time",
    "waiting at an airport gate",
    "the stars seen from a rooftop",
    "a dog waiting for its owner",
    "spring rain on a tin roof",
    "an old pair of boots",
    "the ocean seen by a child for the first time",
    "a candle burning down",
    "the colours of a market in the morning",
]

MATH_TEMPLATES = [
    "Solve this word problem and show your steps: {x}",
    "Math question: {x}",
    "{x} Explain how you got the answer.",
    "Can you help my son with his homework? {x}",
    "Work out the answer step by step. {x}",
    "Here is an arithmetic puzzle: {x} What is the answer?",
    "Solve: {x}",
    "Please calculate the result. {x} Give the final number at the end.",
]
MATH_CONTENT = [
    "A train travels 240 kilometres in 3 hours. What is its average speed?",
    "Sara has 3 times as many apples as Tom. Together they have 48 apples. How many does Sara have?",
    "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
    "If 5 workers build a wall in 12 days, how long would 8 workers take at the same rate?",
    "A rectangle is 7 cm wide and 12 cm long. What is its area and perimeter?",
    "Tickets cost $8 for adults and $5 for children. A family paid $41 for 6 tickets. How many were for children?",
    "A tank holds 500 litres and drains at 20 litres per minute. How long until it is empty?",
    "John is 4 years older than Mary. In 6 years the sum of their ages will be 50. How old is Mary now?",
    "A recipe for 4 people uses 300 grams of rice. How much rice is needed for 10 people?",
    "Two cars leave the same town in opposite directions at 60 km/h and 80 km/h. How far apart are they after 2.5 hours?",
    "A baker sells 120 loaves a day at $2.50 each. What is his revenue in a 6-day week?",
    "The price of a laptop rose from $800 to $920. By what percentage did it increase?",
    "A bag has 5 red, 3 blue and 2 green marbles. What is the probability of drawing a blue one?",
    "Emma reads 25 pages a day. How many days will it take her to finish a 380-page book?",
    "A garden is a square with a side of 9 metres. How much fencing is needed to surround it?",
    "If a pizza is cut into 8 slices and Paul eats 3, what fraction of the pizza is left?",
    "A savings account pays 3% simple interest per year. How much interest does $2,000 earn in 4 years?",
    "A cyclist rides 18 km in 45 minutes. How far would she ride in 2 hours at the same speed?",
    "The sum of three consecutive integers is 72. What are the integers?",
    "A school has 420 students and the ratio of boys to girls is 3:4. How many girls are there?",
    "A phone plan costs $15 per month plus $0.10 per text. Lisa paid $23.50. How many texts did she send?",
    "A pool is 25 m long, 10 m wide and 2 m deep. How many cubic metres of water does it hold?",
    "A farmer has chickens and cows, 30 heads and 74 legs in total. How many cows are there?",
    "A car uses 6 litres of fuel per 100 km. How much fuel is needed for a 450 km trip?",
    "Mark bought 3 notebooks at $2.40 each and a pen for $1.35. How much change does he get from $10?",
    "A clock loses 3 minutes every hour. How many minutes behind will it be after two days?",
    "The average of five numbers is 18. Four of them are 12, 20, 15 and 25. What is the fifth?",
    "A ladder 5 m long leans against a wall with its foot 3 m from the wall. How high does it reach?",
    "A store buys a jacket for $60 and sells it with a 35% markup. What is the selling price?",
    "Anna is twice as old as her brother. Five years ago she was three times as old. How old is her brother?",
    "A printer prints 18 pages per minute. How long does it take to print 450 pages?",
    "A map uses a scale of 1:50,000. Two towns are 7 cm apart on the map. What is the real distance?",
    "A runner completes a 10 km race in 52 minutes. What is her average pace per kilometre?",
    "There are 48 chocolates shared among some children so that each gets 6. How many children are there?",
    "A water bottle is 40% full and holds 300 ml now. What is its full capacity?",
]

GRAMMAR_TEMPLATES = [
    "Fix the grammar in this sentence: {x}",
    "Correct any grammar and spelling mistakes:\n{x}",
    "Proofread the following and return the corrected text only.\n{x}",
    'Please make this sentence grammatically correct: "{x}"',
    "Can you clean up the grammar here? {x}",
    "Edit for grammar, keep the meaning: {x}",
    "There are errors in this text, please fix them: {x}",
    "Rewrite with correct English grammar: {x}",
]
GRAMMAR_CONTENT = [
    "She don't like going to the gym on mondays.",
    "Me and him goes to the same school since five years.",
    "Their going to they're house after the game, but there car is broken.",
    "I has finished my homework yesterday and then I go to bed.",
    "The informations you gave me was very usefull.",
    "Everyone have their own opinion about this subject.",
    "He didn't said nothing about the meeting.",
    "We was waiting for the bus when it start to rain.",
    "The childrens is playing in the garden since morning.",
    "Its a beautiful day, lets go to the beach!",
    "If I would have known, I would of come earlier.",
    "The team are winning they're third match in a row.",
    "Less people came to the party then we expected.",
    "She is more taller than her sister.",
    "I seen that film last week and it were great.",
    "Who's book is this on the table?",
    "Between you and I, the project is late.",
    "The report need to be send before friday.",
    "He go to work by bike everyday.",
    "My friend and me has been to paris twice.",
    "There is many reasons why I like this city.",
    "I am agree with you about the price.",
    "The dog wagged it's tail when he seen me.",
    "Can you borrow me your pen for a minute?",
    "She told me that she will come tomorrow but she didn't came.",
    "Your welcome to join us for dinner, if your free.",
    "They was very exciting about the trip to london.",
    "I have went to that restaurant many times.",
    "The manager, along with his assistants, are arriving soon.",
    "Please advice me on which option is best.",
    "We discussed about the problem for hours.",
    "He is the most smartest student in the class.",
    "The book which I readed last month was interesting.",
    "I look forward to hear from you soon.",
    "Each of the students have a different answer.",
    "Despite of the rain we went for a walk.",
]

TASKS = {
    "translate_fr": (TRANSLATE_TEMPLATES, TRANSLATE_CONTENT),
    "summarize": (SUMMARIZE_TEMPLATES, SUMMARIZE_CONTENT),
    "write_sql": (SQL_TEMPLATES, SQL_CONTENT),
    "sentiment": (SENTIMENT_TEMPLATES, SENTIMENT_CONTENT),
    "extract_entities_json": (ENTITIES_TEMPLATES, ENTITIES_CONTENT),
    "write_poem": (POEM_TEMPLATES, POEM_CONTENT),
    "math_word_problem": (MATH_TEMPLATES, MATH_CONTENT),
    "fix_grammar": (GRAMMAR_TEMPLATES, GRAMMAR_CONTENT),
}


def task_prompts(templates: list[str], content: list[str], count: int, rng: random.Random):
    """`count` distinct (template, content) pairs: every content item is used before any is
    used twice, and an item's second use gets a different phrasing from its first."""
    if count > len(templates) * len(content):
        raise ValueError(f"cannot make {count} distinct prompts from the pools")
    pairs: list[tuple[int, int]] = []
    used: set[tuple[int, int]] = set()
    while len(pairs) < count:
        for c in rng.sample(range(len(content)), len(content)):
            free = [t for t in range(len(templates)) if (t, c) not in used]
            t = rng.choice(free)
            used.add((t, c))
            pairs.append((t, c))
            if len(pairs) == count:
                break
    return [templates[t].format(x=content[c]) for t, c in pairs]


def build_rows(prompts_per_task: int = PROMPTS_PER_TASK, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for task, (templates, content) in TASKS.items():
        for prompt in task_prompts(templates, content, prompts_per_task, rng):
            rows.append({"task": task, "prompt": prompt})
    # Interleave the tasks, as a real job's arrival order would, then number the rows.
    rng.shuffle(rows)
    return [{"id": f"mt-{i:04d}", **row} for i, row in enumerate(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).with_name("mixed_tasks.parquet")))
    args = parser.parse_args()
    rows = build_rows()
    table = pa.table(
        {key: [row[key] for row in rows] for key in ("id", "task", "prompt")},
        schema=pa.schema([("id", pa.string()), ("task", pa.string()), ("prompt", pa.string())]),
    )
    pq.write_table(table, args.out)
    print(f"wrote {len(rows)} prompts of {len(TASKS)} task types to {args.out}")


if __name__ == "__main__":
    main()
