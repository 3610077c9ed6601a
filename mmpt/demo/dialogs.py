"""The demo dialog corpus: generated English task-oriented dialogs labelled with SPACE-2 semantic trees.

Six domains (banking, restaurant, hotel, travel, taxi, weather) and 31 user intents are rendered from paraphrase
templates whose slot placeholders are filled with values, so every slot value has an exact character span. Turn
labels are frames `{domain: {intent_or_act: {slot: [{"value", "span"}]}}}` (greetings and thanks sit under
`DEFAULT_DOMAIN`, bare answers under `DEFAULT_INTENT`), written in the official SPACE-2 format.

Every intent's ten templates are split: the first six render the pre-training dialogs (`labelled/train.json`,
`unlabelled/train.jsonl`), the last four only the DialoGLUE-style intent classification set (`intent/*.csv`), two
for its train split and two for its test split. Test utterances thus have surface forms seen neither in
pre-training nor in few-shot fine-tuning, so accuracy measures how well the learned intent structure transfers,
not recall of memorised sentences or templates. Intents share slots (date, time, city, people) and wording (book,
change and cancel a booking in several domains) so keywords alone do not solve the task.

Deterministic (a seeded `random.Random`, no set iteration): two builds are byte-identical. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from mmpt.demo import register
from mmpt.demo.corpus import COMPLETE_MARKER, fresh_staging, is_built, publish

DEFAULT_DOMAIN = "DEFAULT_DOMAIN"
DEFAULT_INTENT = "DEFAULT_INTENT"
HELDOUT_TEMPLATES = 4  # the last four of every intent's ten templates: two for intent train, two for intent test

# Where a taxi picks up and drops off.
PLACES = [
    "the airport",
    "the train station",
    "Main Street",
    "the city centre",
    "Central Park",
    "the museum",
    "my hotel",
    "Oak Avenue",
    "the harbour",
    "the university",
    "the stadium",
    "King Street",
]
CITIES = [
    "London",
    "Paris",
    "Berlin",
    "Madrid",
    "Rome",
    "Boston",
    "Chicago",
    "Seattle",
    "Denver",
    "Dublin",
    "Lisbon",
    "Vienna",
    "Prague",
    "Toronto",
    "Austin",
    "Oslo",
    "New York",
    "San Francisco",
    "Amsterdam",
    "Edinburgh",
]
TIMES = [
    "7 pm",
    "7:30 pm",
    "8 pm",
    "noon",
    "6:15 pm",
    "9 am",
    "8:45 am",
    "1 pm",
    "6 pm",
    "10:30 am",
    "11 am",
    "5:45 pm",
    "9:30 pm",
    "2 pm",
]
VALUES: dict[str, list[str]] = {
    "account": ["checking", "savings", "current", "business", "joint", "student", "travel", "holiday"],
    "amount": [
        "$50",
        "$120",
        "$75",
        "$1,000",
        "$250",
        "$20",
        "300 dollars",
        "45 euros",
        "$2,500",
        "$600",
        "$35",
        "80 pounds",
        "$400",
        "$15",
    ],
    "recipient": [
        "Alice",
        "my landlord",
        "John Smith",
        "my sister",
        "Maria Lopez",
        "the plumber",
        "my brother",
        "Kevin",
        "my mum",
        "Dr. Patel",
        "the school",
        "Omar",
    ],
    "card_type": ["debit", "credit", "Visa", "Mastercard", "virtual", "platinum", "business", "prepaid"],
    "currency": [
        "euros",
        "dollars",
        "pounds",
        "yen",
        "Swiss francs",
        "Canadian dollars",
        "pesos",
        "rupees",
        "Australian dollars",
        "kroner",
    ],
    "rate": ["0.92", "1.27", "0.79", "151.30", "17.05", "1.36", "0.88", "83.10"],
    "date": [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "May 4th",
        "June 12th",
        "July 1st",
        "August 19th",
        "September 3rd",
        "October 30th",
        "the 21st",
        "the 15th",
    ],
    "time": TIMES,
    "open_time": TIMES,
    "close_time": TIMES,
    "people": ["2", "3", "4", "5", "6", "8", "two", "four", "three", "ten"],
    "cuisine": [
        "Italian",
        "Chinese",
        "Thai",
        "Indian",
        "Mexican",
        "Japanese",
        "French",
        "Greek",
        "vegan",
        "Korean",
        "Lebanese",
        "Spanish",
    ],
    "price": ["cheap", "moderately priced", "expensive", "mid-range", "budget", "upscale"],
    "area": ["north", "south", "east", "west", "centre", "old town"],
    "restaurant": [
        "Bella Roma",
        "The Golden Wok",
        "Spice Garden",
        "Le Petit Bistro",
        "Taco Loco",
        "Sakura House",
        "The Olive Tree",
        "Seoul Kitchen",
        "Cedar Grill",
        "Casa Pepe",
    ],
    "hotel": [
        "Grand Plaza",
        "Riverside Inn",
        "Park View Hotel",
        "Harbor Lodge",
        "The Royal Crown",
        "City Nest",
        "Maple Suites",
        "The Alpine",
    ],
    "stars": ["2", "3", "4", "5", "two", "three", "four", "five"],
    "nights": ["2", "3", "4", "5", "6", "7", "two", "three"],
    "amenity": [
        "free wifi",
        "parking",
        "a pool",
        "breakfast",
        "a gym",
        "an airport shuttle",
        "a spa",
        "room service",
        "a bar",
        "laundry",
    ],
    "city": CITIES,
    "departure": CITIES,
    "destination": CITIES,
    "flight": [
        "BA 117",
        "LH 402",
        "AF 1280",
        "UA 935",
        "DL 48",
        "KL 1007",
        "IB 3166",
        "EI 155",
        "SK 903",
        "AC 870",
        "TP 219",
        "LX 318",
    ],
    "seat_class": ["economy", "business", "first class", "premium economy"],
    "status": ["on time", "delayed by 40 minutes", "delayed by two hours", "boarding now", "cancelled", "landed"],
    "bags": ["one", "two", "three"],
    "pickup": PLACES,
    "dropoff": PLACES,
    "car": ["white Toyota", "black Skoda", "blue Tesla", "grey Honda", "silver Ford"],
    "eta": ["5 minutes", "10 minutes", "3 minutes", "a quarter of an hour", "20 minutes"],
    "condition": ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "stormy"],
    "temperature": ["12 degrees", "25 degrees", "minus 3 degrees", "18 degrees", "30 degrees", "7 degrees"],
}


@dataclass(frozen=True)
class Intent:
    """Paraphrase templates (pre-training first, the last `HELDOUT_TEMPLATES` held out), the slots the system asks
    for when the user left them out, and the system's inform replies."""

    templates: tuple[str, ...]
    asks: tuple[str, ...] = ()
    replies: tuple[str, ...] = ()

    @property
    def pretrain_templates(self) -> tuple[str, ...]:
        return self.templates[:-HELDOUT_TEMPLATES]

    @property
    def heldout_templates(self) -> tuple[str, ...]:
        return self.templates[-HELDOUT_TEMPLATES:]

    def intent_templates(self, split: str) -> tuple[str, ...]:
        """The held-out templates of the intent classification `split` ("train" or "test"): disjoint halves."""
        half = HELDOUT_TEMPLATES // 2
        return self.heldout_templates[:half] if split == "train" else self.heldout_templates[half:]


def _intent(templates: list[str], asks: tuple[str, ...], replies: list[str]) -> Intent:
    return Intent(tuple(templates), asks, tuple(replies))


# domain -> intent -> Intent. In each list of ten templates the first six render pre-training dialogs, the next two
# the intent classification train split and the last two its test split.
INTENTS: dict[str, dict[str, Intent]] = {
    "banking": {
        "check_balance": _intent(
            [
                "What is the balance of my {account} account?",
                "How much money do I have in my {account} account?",
                "Can you tell me my {account} balance?",
                "I want to check my balance.",
                "Show me how much is left in my {account} account.",
                "Please check the balance on my {account} account as of {date}.",
                "How much is sitting in my {account} account right now?",
                "what did my {account} account hold on {date}",
                "Could you look up the remaining funds in {account} for me?",
                "I'd like to know what's left in {account} after {date}.",
            ],
            ("account",),
            ["Your {account} account balance is {amount}.", "You have {amount} in your {account} account."],
        ),
        "transfer_money": _intent(
            [
                "I want to transfer {amount} to {recipient}.",
                "Send {amount} to {recipient} from my {account} account.",
                "Can you move {amount} from {account} to {recipient}?",
                "Please wire {amount} to {recipient} on {date}.",
                "I need to make a transfer.",
                "Transfer {amount} to {recipient}, please.",
                "Pay {recipient} {amount} out of my {account} account.",
                "I'd like {recipient} to receive {amount} from me by {date}.",
                "could you send some money to {recipient} from {account}",
                "Put {amount} into the account of {recipient}, please.",
            ],
            ("amount", "recipient"),
            ["Done, {amount} is on its way to {recipient}.", "I have sent {amount} to {recipient}."],
        ),
        "cancel_transfer": _intent(
            [
                "Cancel the transfer to {recipient}.",
                "I want to cancel the {amount} transfer I made to {recipient}.",
                "Please stop my transfer of {amount}.",
                "I sent money to the wrong person, can you cancel it?",
                "Can you reverse the payment to {recipient} from {date}?",
                "Undo the transfer I made on {date}.",
                "I'd like to call back the {amount} I sent to {recipient}.",
                "Stop the payment to {recipient} before it goes through.",
                "the transfer from {date} for {amount} was a mistake, please revoke it",
                "Please hold back the {amount} going to {recipient}.",
            ],
            ("recipient",),
            ["The transfer to {recipient} has been cancelled.", "I cancelled the payment of {amount}."],
        ),
        "transfer_status": _intent(
            [
                "Why hasn't my transfer to {recipient} arrived yet?",
                "My transfer of {amount} is still pending.",
                "Has the money I sent to {recipient} gone through?",
                "When will my transfer from {date} arrive?",
                "I made a transfer but it's not showing up.",
                "Check the status of my {amount} transfer to {recipient}.",
                "{recipient} says they still haven't received my {amount}.",
                "Is the payment I sent on {date} still processing?",
                "how long until {recipient} gets the money I sent",
                "Where is the {amount} I paid {recipient} on {date}?",
            ],
            ("recipient",),
            ["The transfer to {recipient} should arrive by {date}.", "Your {amount} transfer is still processing."],
        ),
        "card_lost": _intent(
            [
                "I lost my {card_type} card.",
                "My {card_type} card was stolen yesterday.",
                "I can't find my card anywhere.",
                "Someone took my {card_type} card, please block it.",
                "Please freeze my {card_type} card, I think I left it in {city}.",
                "My wallet with my {card_type} card is gone.",
                "I misplaced my {card_type} card somewhere in {city}.",
                "I think my {card_type} card got pickpocketed on {date}.",
                "block my {card_type} card right away, it went missing in {city}",
                "There's been no sign of my {card_type} card since {date}.",
            ],
            ("card_type",),
            ["I have blocked your {card_type} card and ordered a new one.", "Your {card_type} card is now frozen."],
        ),
        "activate_card": _intent(
            [
                "How do I activate my new {card_type} card?",
                "I'd like to activate my card.",
                "My {card_type} card arrived, can you activate it?",
                "Please turn on my new {card_type} card.",
                "Activate the {card_type} card I received on {date}.",
                "I need to start using my {card_type} card.",
                "The new {card_type} card came in the mail on {date}, how do I set it up?",
                "Can you enable the {card_type} card you sent me?",
                "what do I do to get my {card_type} card working in {city}",
                "Help me get the {card_type} card live before {date}.",
            ],
            ("card_type",),
            ["Your {card_type} card is now active.", "I activated the {card_type} card for you."],
        ),
        "card_declined": _intent(
            [
                "My {card_type} card was declined.",
                "Why was my card declined at the shop?",
                "My {card_type} card got rejected when I tried to pay {amount}.",
                "The payment with my {card_type} card didn't go through.",
                "I couldn't pay with my card in {city} on {date}.",
                "My {card_type} card keeps getting declined.",
                "The terminal refused my {card_type} card for a {amount} purchase.",
                "why won't my {card_type} card work in {city}",
                "A merchant turned down my {card_type} card on {date}.",
                "The {card_type} card bounced when I paid {amount} in {city}.",
            ],
            ("card_type",),
            [
                "Your {card_type} card hit its daily limit of {amount}.",
                "The {card_type} card was declined because it is frozen.",
            ],
        ),
        "exchange_rate": _intent(
            [
                "What is the exchange rate for {currency}?",
                "How many {currency} do I get for {amount}?",
                "What's the current rate to convert dollars to {currency}?",
                "I want to know the exchange rate.",
                "How much is {amount} in {currency}?",
                "Tell me the {currency} rate for {date}.",
                "If I change {amount} into {currency}, how much will I get?",
                "what are you charging to buy {currency} on {date}",
                "Is the {currency} rate better now than it was on {date}?",
                "How many {currency} will {amount} buy me?",
            ],
            ("currency",),
            ["The rate is {rate} {currency} per dollar.", "{amount} is about {rate} {currency} today."],
        ),
    },
    "restaurant": {
        "find_restaurant": _intent(
            [
                "I'm looking for a {cuisine} restaurant in the {area}.",
                "Can you find me a {price} place to eat?",
                "Is there a good {cuisine} place in {city}?",
                "I want somewhere to eat in the {area} of town.",
                "Recommend a {price} {cuisine} restaurant.",
                "I need a restaurant.",
                "Where can I get {cuisine} food in the {area}?",
                "any {price} spots for dinner in {city}",
                "Suggest a {cuisine} restaurant in {city} that is {price}.",
                "Point me to a {price} {cuisine} restaurant in the {area}.",
            ],
            ("cuisine", "area"),
            ["{restaurant} serves {cuisine} food in the {area}.", "How about {restaurant}? It is {price}."],
        ),
        "book_table": _intent(
            [
                "I'd like to book a table for {people} at {restaurant}.",
                "Book a table for {people} people on {date} at {time}.",
                "Can I reserve a table at {restaurant} for {date}?",
                "Reserve a table for {people} at {time}.",
                "I want to make a reservation.",
                "Please get me a table at {restaurant} at {time} on {date}.",
                "Could you hold a table for {people} at {restaurant} around {time}?",
                "we are {people} people and want to eat at {restaurant} on {date}",
                "Grab us a table on {date} at {time}, please.",
                "Save a spot for {people} at {restaurant} at {time}.",
            ],
            ("people", "date", "time"),
            [
                "Your table for {people} at {restaurant} is booked for {time}.",
                "Booked: {restaurant} on {date} at {time}.",
            ],
        ),
        "cancel_booking": _intent(
            [
                "Cancel my table at {restaurant}.",
                "I need to cancel my reservation for {date}.",
                "Please cancel the booking for {people} at {time}.",
                "I won't make it to {restaurant} on {date}, cancel it.",
                "Can you cancel my restaurant booking?",
                "Drop my dinner reservation at {restaurant}.",
                "We can't come to {restaurant} at {time} anymore, please remove the booking.",
                "call off the table for {people} on {date}",
                "Please scrap my {restaurant} reservation for {date}.",
                "Take my name off the list at {restaurant} for {time}.",
            ],
            ("restaurant",),
            ["Your reservation at {restaurant} is cancelled.", "I cancelled the table for {date}."],
        ),
        "change_booking": _intent(
            [
                "Can I move my reservation at {restaurant} to {time}?",
                "Change my table booking to {date}.",
                "I need to change the number of people to {people}.",
                "Please push my dinner reservation back to {time}.",
                "I want to change my restaurant booking.",
                "Can we make the table at {restaurant} for {people} instead?",
                "Shift my {restaurant} reservation to {date} at {time}.",
                "is it possible to reschedule the table for {people} to {time}",
                "Please update my booking at {restaurant} so it's on {date}.",
                "Could the reservation at {restaurant} be moved to {time} on {date}?",
            ],
            ("restaurant",),
            ["Your booking at {restaurant} now starts at {time}.", "I moved your table to {date}."],
        ),
        "opening_hours": _intent(
            [
                "What time does {restaurant} open?",
                "When does {restaurant} close on {date}?",
                "Is {restaurant} open at {time}?",
                "What are the opening hours of {restaurant}?",
                "Are they open tonight?",
                "How late is {restaurant} open on {date}?",
                "Will {restaurant} still be serving at {time} on {date}?",
                "until when can I eat at {restaurant} on {date}",
                "Is {restaurant} closed on {date}?",
                "Can I still get a meal at {restaurant} at {time}?",
            ],
            ("restaurant",),
            ["{restaurant} opens at {open_time} and closes at {close_time}.", "They close at {close_time} on {date}."],
        ),
    },
    "hotel": {
        "find_hotel": _intent(
            [
                "I'm looking for a hotel in {city}.",
                "Find me a {price} hotel in the {area}.",
                "Is there a {stars} star hotel in {city}?",
                "I need a place to stay.",
                "Can you recommend a {price} hotel in the {area}?",
                "Show me {stars} star hotels in {city} with {amenity}.",
                "What {price} accommodation is there in {city}?",
                "any {stars} star places to sleep in the {area}",
                "I want a hotel in {city} that has {amenity}.",
                "Look for a {stars} star hotel in the {area} of {city}.",
            ],
            ("city",),
            ["{hotel} is a {stars} star hotel in {city}.", "I found {hotel}, a {price} option in the {area}."],
        ),
        "book_room": _intent(
            [
                "I'd like to book a room at {hotel}.",
                "Book a room for {people} people for {nights} nights.",
                "Can I reserve a room at {hotel} from {date}?",
                "Reserve {nights} nights at {hotel}, please.",
                "I want to book a hotel room.",
                "Please book me a double room in {city} starting {date}.",
                "Could you get me a room at {hotel} for {nights} nights from {date}?",
                "we need somewhere for {people} people at {hotel} on {date}",
                "Hold a room in {city} for {nights} nights, please.",
                "Sort me out a room at {hotel} from {date} for {people} guests.",
            ],
            ("date", "nights"),
            ["Your room at {hotel} is booked for {nights} nights from {date}.", "Booked: {hotel}, {nights} nights."],
        ),
        "cancel_booking": _intent(
            [
                "Cancel my reservation at {hotel}.",
                "I need to cancel my hotel booking for {date}.",
                "Please cancel the room I booked in {city}.",
                "I'm not going to {hotel} anymore, cancel my stay.",
                "Can you cancel my hotel reservation?",
                "Cancel the {nights} night stay at {hotel}.",
                "We won't be staying at {hotel} on {date}, please remove the booking.",
                "call off my room in {city} on {date}",
                "Please scrap my {hotel} reservation for {nights} nights.",
                "Take my booking at {hotel} for {date} off the system, please.",
            ],
            ("hotel",),
            ["Your stay at {hotel} is cancelled.", "I cancelled your room for {date}."],
        ),
        "change_booking": _intent(
            [
                "Can I change my reservation at {hotel} to {date}?",
                "Extend my stay to {nights} nights.",
                "I need to change the number of guests to {people}.",
                "Please move my hotel booking to {date}.",
                "I want to change my hotel reservation.",
                "Can we switch my room at {hotel} to {people} people?",
                "Shift my {hotel} reservation to {date} for {nights} nights.",
                "is it possible to reschedule my stay in {city} to {date}",
                "Please update my booking at {hotel} so it's for {people} guests.",
                "Could my stay at {hotel} be moved to {date}?",
            ],
            ("hotel",),
            ["Your booking at {hotel} now starts on {date}.", "Your stay is now {nights} nights."],
        ),
        "hotel_amenities": _intent(
            [
                "Does {hotel} have {amenity}?",
                "Is there {amenity} at the hotel?",
                "Does the hotel in {city} offer {amenity}?",
                "What facilities does {hotel} have?",
                "Do I get {amenity} with my room?",
                "Can you check if {hotel} provides {amenity}?",
                "Will I have access to {amenity} at {hotel}?",
                "is {amenity} included when staying at {hotel}",
                "Does my room in {city} come with {amenity}?",
                "Is {amenity} something {hotel} offers its guests?",
            ],
            ("hotel",),
            ["Yes, {hotel} has {amenity}.", "{hotel} offers {amenity} to all guests."],
        ),
    },
    "travel": {
        "book_flight": _intent(
            [
                "I want to fly from {departure} to {destination}.",
                "Book a flight to {destination} on {date}.",
                "Can you get me a {seat_class} ticket from {departure} to {destination}?",
                "I need a flight.",
                "Find me a flight to {destination} leaving at {time}.",
                "Please book {people} seats on a flight to {destination} for {date}.",
                "Get me on a plane from {departure} to {destination} on {date}.",
                "I'd like to fly {seat_class} to {destination}",
                "are there any flights to {destination} around {time} on {date}",
                "Secure me a {seat_class} seat flying to {destination} on {date}.",
            ],
            ("destination", "date"),
            [
                "You are booked on flight {flight} to {destination} on {date}.",
                "I booked a {seat_class} seat on {flight} leaving at {time}.",
            ],
        ),
        "book_train": _intent(
            [
                "I want a train from {departure} to {destination}.",
                "Book a train ticket to {destination} for {date}.",
                "Can you get me {people} train tickets to {destination}?",
                "I need to take the train.",
                "Find me a train to {destination} leaving after {time}.",
                "Reserve a {seat_class} seat on the train from {departure} on {date}.",
                "Get me on a train from {departure} to {destination} on {date}.",
                "I'd like to go to {destination} by rail in {seat_class}",
                "are there any trains to {destination} around {time} on {date}",
                "Secure me a {seat_class} seat on a train to {destination} on {date}.",
            ],
            ("destination", "date"),
            [
                "Your train to {destination} leaves at {time} on {date}.",
                "I booked a {seat_class} seat on the {time} train to {destination}.",
            ],
        ),
        "cancel_booking": _intent(
            [
                "Cancel my flight to {destination}.",
                "I need to cancel my train ticket for {date}.",
                "Please cancel my trip from {departure} to {destination}.",
                "I'm not travelling to {destination} anymore, cancel my ticket.",
                "Can you cancel my travel booking?",
                "Cancel flight {flight}.",
                "We won't be flying to {destination} on {date}, please refund the ticket.",
                "call off my trip to {destination} on {date}",
                "Please scrap my booking on flight {flight}.",
                "I want a refund for my ticket to {destination} on {date}.",
            ],
            ("destination",),
            ["Your trip to {destination} is cancelled.", "Flight {flight} has been cancelled and refunded."],
        ),
        "flight_status": _intent(
            [
                "Is flight {flight} on time?",
                "What's the status of my flight to {destination}?",
                "Has flight {flight} been delayed?",
                "When does my flight from {departure} land?",
                "Is my flight on schedule?",
                "Check if flight {flight} on {date} is cancelled.",
                "Will flight {flight} leave as planned?",
                "is the plane from {departure} to {destination} running late",
                "Any delays for {flight} on {date}?",
                "Is {flight} arriving from {departure} on schedule?",
            ],
            ("flight",),
            ["Flight {flight} is {status}.", "Your flight from {departure} is {status}."],
        ),
        "train_times": _intent(
            [
                "When is the next train to {destination}?",
                "What time do trains leave {departure} for {destination}?",
                "Show me the train schedule for {date}.",
                "What trains are there after {time}?",
                "When does the last train to {destination} leave?",
                "I need the train timetable.",
                "What are the departure times from {departure} to {destination} on {date}?",
                "how often do trains run to {destination} on {date}",
                "Is there a train to {destination} before {time}?",
                "Give me the times of trains between {departure} and {destination}.",
            ],
            ("destination",),
            [
                "The next train to {destination} leaves at {time}.",
                "On {date} the first train leaves {departure} at {time}.",
            ],
        ),
        "baggage_allowance": _intent(
            [
                "How much luggage can I bring on my flight?",
                "What is the baggage allowance for {seat_class}?",
                "Can I take two bags on flight {flight}?",
                "How heavy can my suitcase be when flying to {destination}?",
                "Is checked baggage included in a {seat_class} ticket?",
                "What are the luggage rules for my flight?",
                "How many suitcases are allowed in {seat_class} on flight {flight}?",
                "do I pay extra for a bag when flying {seat_class} to {destination}",
                "What's the weight limit for luggage to {destination}?",
                "How many kilos can I check in on {flight} to {destination}?",
            ],
            ("seat_class",),
            ["In {seat_class} you can check {bags} bags.", "Flight {flight} allows {bags} checked bags."],
        ),
    },
    "taxi": {
        "book_taxi": _intent(
            [
                "I need a taxi from {pickup} to {dropoff}.",
                "Book a cab to {dropoff} at {time}.",
                "Can you send a taxi to {pickup}?",
                "Get me a taxi, please.",
                "I want a ride to {dropoff} from {pickup} at {time}.",
                "Please order a taxi for {people} people to {dropoff}.",
                "Could a car pick me up at {pickup} around {time}?",
                "I need a lift to {dropoff} on {date}",
                "Arrange a cab from {pickup} to {dropoff}, please.",
                "Send a car to {pickup} at {time} to take me to {dropoff}.",
            ],
            ("pickup", "time"),
            ["A taxi will pick you up at {pickup} at {time}.", "Your cab to {dropoff} is booked, look for a {car}."],
        ),
        "cancel_booking": _intent(
            [
                "Cancel my taxi.",
                "I don't need the cab to {dropoff} anymore.",
                "Please cancel the taxi booked for {time}.",
                "Cancel the ride from {pickup}.",
                "Can you cancel my taxi booking to {dropoff}?",
                "Call off the cab I ordered for {date}.",
                "We won't need the car at {pickup} at {time}, please remove the booking.",
                "scrap my taxi to {dropoff}",
                "Please cancel the cab booking for {date} at {time}.",
                "The cab from {pickup} on {date} is no longer needed.",
            ],
            ("pickup",),
            ["Your taxi to {dropoff} is cancelled.", "I cancelled the cab for {time}."],
        ),
        "taxi_eta": _intent(
            [
                "Where is my taxi?",
                "How long until the cab arrives at {pickup}?",
                "When will my taxi get here?",
                "Is the taxi to {dropoff} on its way?",
                "My cab was supposed to come at {time}, where is it?",
                "How far away is my driver?",
                "The car for {pickup} is late, when will it show up?",
                "how many minutes until my {time} ride to {dropoff} gets here",
                "I booked a taxi for {time} at {pickup}, is it close?",
                "Is my driver near {pickup} yet? I booked for {time}.",
            ],
            ("pickup",),
            ["Your driver will be at {pickup} in {eta}.", "The {car} is {eta} away."],
        ),
        "taxi_fare": _intent(
            [
                "How much is a taxi to {dropoff}?",
                "What would a cab from {pickup} to {dropoff} cost?",
                "How much will the ride cost?",
                "Is a taxi to {dropoff} more than {amount}?",
                "Give me a price for a cab from {pickup}.",
                "What's the fare to {dropoff} at {time}?",
                "Roughly what do I pay to get from {pickup} to {dropoff} by car?",
                "is {amount} enough for a cab to {dropoff}",
                "How expensive is a ride from {pickup} on {date}?",
                "What's a ride from {pickup} to {dropoff} going to set me back?",
            ],
            ("dropoff",),
            ["A ride to {dropoff} costs about {amount}.", "It should be around {amount}."],
        ),
    },
    "weather": {
        "weather_forecast": _intent(
            [
                "What's the weather like in {city}?",
                "Give me the forecast for {city} on {date}.",
                "How will the weather be on {date}?",
                "What's the weather forecast?",
                "Tell me the weather in {city} for {date}.",
                "Is it going to be nice in {city} this week?",
                "What kind of weather should I expect in {city} on {date}?",
                "how's it looking outside in {city}",
                "Could you check the outlook for {date} in {city}?",
                "What's the sky going to do in {city} on {date}?",
            ],
            ("city",),
            ["It will be {condition} in {city} on {date}.", "Expect {condition} weather with {temperature}."],
        ),
        "will_it_rain": _intent(
            [
                "Will it rain in {city} on {date}?",
                "Do I need an umbrella today?",
                "Is rain expected in {city}?",
                "Should I bring an umbrella to {city} on {date}?",
                "What are the chances of rain on {date}?",
                "Is it going to pour in {city}?",
                "Am I going to get wet in {city} on {date}?",
                "any showers expected in {city}",
                "Will {date} be a rainy day in {city}?",
                "Is {city} getting any rain on {date}?",
            ],
            ("city",),
            ["Yes, rain is expected in {city} on {date}.", "No rain today, it will be {condition}."],
        ),
        "temperature": _intent(
            [
                "How hot will it be in {city}?",
                "What's the temperature in {city} on {date}?",
                "How cold is it outside?",
                "Will it be warm in {city} on {date}?",
                "What temperature is it going to be on {date}?",
                "Is it freezing in {city} right now?",
                "How many degrees will it be in {city} on {date}?",
                "should I wear a coat in {city}",
                "What's the high for {date} in {city}?",
                "How warm or cold will {city} be on {date}?",
            ],
            ("city",),
            ["It will be {temperature} in {city}.", "Expect a high of {temperature} on {date}."],
        ),
    },
}

# The system's request for a missing slot (act "request", slot with no values) and the user's answer to it.
REQUESTS: dict[str, list[str]] = {
    "account": ["Which account would you like me to use?", "Which account is this about?"],
    "amount": ["How much would you like to send?", "What amount are we talking about?"],
    "recipient": ["Who is the recipient?", "Who should receive the money?"],
    "card_type": ["Which card is it?", "Which of your cards is this about?"],
    "currency": ["Which currency are you interested in?", "Which currency do you need?"],
    "cuisine": ["What type of food would you like?", "Any particular cuisine?"],
    "area": ["Which part of town?", "What area are you looking in?"],
    "people": ["How many people will there be?", "For how many guests?"],
    "date": ["What day would you like?", "For which date?"],
    "time": ["What time would suit you?", "At what time?"],
    "restaurant": ["Which restaurant is it?", "What is the name of the restaurant?"],
    "city": ["Which city?", "In which city?"],
    "nights": ["How many nights will you stay?", "For how many nights?"],
    "hotel": ["Which hotel is it?", "What is the name of the hotel?"],
    "destination": ["Where are you heading?", "What is your destination?"],
    "flight": ["What is your flight number?", "Which flight is it?"],
    "seat_class": ["Which class would you like to travel in?", "Which cabin class?"],
    "pickup": ["Where should the driver pick you up?", "What is the pick-up address?"],
    "dropoff": ["Where are you going?", "Where to?"],
}
ANSWERS: dict[str, list[str]] = {
    "account": ["My {account} account.", "The {account} one."],
    "amount": ["{amount}, please.", "Make it {amount}."],
    "recipient": ["It's for {recipient}.", "Send it to {recipient}."],
    "card_type": ["My {card_type} card.", "It's the {card_type} one."],
    "currency": ["I need {currency}.", "{currency}, please."],
    "cuisine": ["Something {cuisine}.", "I'd like {cuisine} food."],
    "area": ["In the {area}.", "The {area}, please."],
    "people": ["There will be {people} of us.", "For {people}, please."],
    "date": ["On {date}.", "{date} would be great."],
    "time": ["At {time}, please.", "{time} works for me."],
    "restaurant": ["It's at {restaurant}.", "The one at {restaurant}."],
    "city": ["In {city}.", "{city}, please."],
    "nights": ["For {nights} nights.", "{nights} nights, please."],
    "hotel": ["It's {hotel}.", "The booking at {hotel}."],
    "destination": ["I'm going to {destination}.", "To {destination}."],
    "flight": ["It's flight {flight}.", "Flight {flight}."],
    "seat_class": ["In {seat_class}.", "{seat_class}, please."],
    "pickup": ["Pick me up at {pickup}.", "From {pickup}."],
    "dropoff": ["I'm going to {dropoff}.", "To {dropoff}, please."],
}
# Turns with no domain: (role, act) -> texts.
GENERAL: dict[tuple[str, str], list[str]] = {
    ("user", "greet"): ["Hi there.", "Hello!", "Good morning.", "Hey, can you help me?", "Hi, I need some help."],
    ("system", "greet"): [
        "Hello, how can I help you today?",
        "Hi! What can I do for you?",
        "Good day, how can I help?",
    ],
    ("user", "thank"): ["Thanks, that's all.", "Thank you so much!", "Great, thanks.", "Perfect, thank you."],
    ("user", "bye"): ["That's everything, bye.", "Okay, goodbye.", "Nothing else, bye!"],
    ("system", "welcome"): ["You're welcome!", "Happy to help.", "My pleasure."],
    ("system", "bye"): ["Goodbye, have a nice day!", "Bye, take care."],
}

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def categories() -> list[str]:
    """Intent classification labels, `<domain>_<intent>`, sorted."""
    return sorted(f"{domain}_{name}" for domain, intents in INTENTS.items() for name in intents)


def slots_of(template: str) -> list[str]:
    return _PLACEHOLDER.findall(template)


def fill(template: str, values: dict[str, str]) -> tuple[str, dict[str, list[dict]]]:
    """Render `template` with `values`; returns the text and `{slot: [{"value", "span": [start, end)}]}`."""
    pieces: list[str] = []
    slots: dict[str, list[dict]] = {}
    cursor = position = 0
    for match in _PLACEHOLDER.finditer(template):
        literal = template[cursor : match.start()]
        value = values[match.group(1)]
        start = position + len(literal)
        pieces += [literal, value]
        slots.setdefault(match.group(1), []).append({"value": value, "span": [start, start + len(value)]})
        position = start + len(value)
        cursor = match.end()
    pieces.append(template[cursor:])
    return "".join(pieces), slots


def _draw(rng: random.Random, slot: str, state: dict[str, str]) -> str:
    """A value for `slot`, different from values already used in the dialog (from and to are never equal)."""
    taken = set(state.values())
    choices = [value for value in VALUES[slot] if value not in taken] or VALUES[slot]
    return rng.choice(choices)


def _render(rng: random.Random, template: str, state: dict[str, str]) -> tuple[str, dict[str, list[dict]]]:
    """Fill `template`, reusing values the dialog already has and drawing (and remembering) the others."""
    for slot in slots_of(template):
        if slot not in state:
            state[slot] = _draw(rng, slot, state)
    return fill(template, state)


def _turn(role: str, text: str, label: dict) -> dict:
    return {"role": role, "text": text, "label": label}


def _general(rng: random.Random, role: str, act: str) -> dict:
    return _turn(role, rng.choice(GENERAL[(role, act)]), {DEFAULT_DOMAIN: {act: {}}})


def _dialog(rng: random.Random, goals: list[tuple[str, str]]) -> list[dict]:
    """One dialog of 1-4 turns, user first, rendered from pre-training templates only."""
    domain, name = rng.choice(goals)
    intent = INTENTS[domain][name]
    state: dict[str, str] = {}
    script: list[dict] = []
    greeting = rng.random() < 0.1
    if greeting:
        script += [_general(rng, "user", "greet"), _general(rng, "system", "greet")]
    text, slots = _render(rng, rng.choice(intent.pretrain_templates), state)
    script.append(_turn("user", text, {domain: {name: slots}}))
    missing = [slot for slot in intent.asks if slot not in state]
    if missing:
        slot = missing[0]
        script.append(_turn("system", rng.choice(REQUESTS[slot]), {domain: {"request": {slot: []}}}))
        state[slot] = _draw(rng, slot, state)
        if rng.random() < 0.2:  # a bare value: the slot is known, the intent is not annotated
            text, slots = fill(f"{{{slot}}}", state)
            script.append(_turn("user", text, {domain: {DEFAULT_INTENT: slots}}))
        else:
            text, slots = fill(rng.choice(ANSWERS[slot]), state)
            script.append(_turn("user", text, {domain: {name: slots}}))
        text, slots = _render(rng, rng.choice(intent.replies), state)
        script.append(_turn("system", text, {domain: {"inform": slots}}))
    else:
        text, slots = _render(rng, rng.choice(intent.replies), state)
        script.append(_turn("system", text, {domain: {"inform": slots}}))
        closing = rng.choice(["thank", "thank", "bye"])
        script.append(_general(rng, "user", closing))
        script.append(_general(rng, "system", "welcome" if closing == "thank" else "bye"))
    length = rng.choice([3, 4]) if greeting else rng.choice([1, 2, 2, 3, 3, 4, 4, 4])
    return [{"turn_id": turn_id, **turn} for turn_id, turn in enumerate(script[:length])]


def _goals() -> list[tuple[str, str]]:
    return [(domain, name) for domain, intents in INTENTS.items() for name in intents]


def _intent_examples(rng: random.Random, sizes: dict[str, int], seen: set[str]) -> dict[str, list[list[str]]]:
    """`{split: rows}` of `[text, category]` rendered from the split's held-out templates with fresh values: unique,
    and never the text of a pre-training user turn (`seen`)."""
    out: dict[str, list[list[str]]] = {split: [] for split in sizes}
    for domain, name in _goals():
        category, intent = f"{domain}_{name}", INTENTS[domain][name]
        for split, size in sizes.items():
            templates = intent.intent_templates(split)
            texts: list[str] = []
            known: set[str] = set()
            for _ in range(50 * size):
                if len(texts) == size:
                    break
                text, _slots = _render(rng, rng.choice(templates), {})
                if text not in known and text not in seen:
                    known.add(text)
                    texts.append(text)
            out[split] += [[text, category] for text in texts]
    return out


def _csv(rows: list[list[str]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["text", "category"])
    writer.writerows(rows)
    return buffer.getvalue()


def build_dialogs(
    root: str | os.PathLike,
    seed: int = 0,
    *,
    labelled_dialogs: int = 1200,
    unlabelled_dialogs: int = 4000,
    intent_train: int = 30,
    intent_test: int = 20,
) -> Path:
    """Build the corpus at `root` unless already complete; safe when several ranks race to build it.

    Layout: `labelled/train.json` (official SPACE-2 format), `unlabelled/train.jsonl` (`{"id", "turns": [{"role",
    "text"}]}` lines), `intent/{train,test}.csv` (`text,category`) with `intent/categories.json`, `stats.json`.
    """
    root = Path(root)
    if is_built(root):
        return root
    staging = fresh_staging(root)
    goals = _goals()

    labelled_rng = random.Random(f"demo-dialogs-labelled-{seed}")
    labelled = {f"lab-{index:05d}": {"turns": _dialog(labelled_rng, goals)} for index in range(labelled_dialogs)}
    unlabelled_rng = random.Random(f"demo-dialogs-unlabelled-{seed}")
    unlabelled = [
        {
            "id": f"unl-{index:05d}",
            "turns": [{"role": t["role"], "text": t["text"]} for t in _dialog(unlabelled_rng, goals)],
        }
        for index in range(unlabelled_dialogs)
    ]

    seen = {turn["text"] for dialog in labelled.values() for turn in dialog["turns"] if turn["role"] == "user"}
    seen |= {turn["text"] for dialog in unlabelled for turn in dialog["turns"] if turn["role"] == "user"}
    sizes = {"train": intent_train, "test": intent_test}
    intent = _intent_examples(random.Random(f"demo-dialogs-intent-{seed}"), sizes, seen)

    (staging / "labelled").mkdir(parents=True)
    (staging / "unlabelled").mkdir()
    (staging / "intent").mkdir()
    (staging / "labelled" / "train.json").write_text(json.dumps(labelled, ensure_ascii=False) + "\n", encoding="utf-8")
    (staging / "unlabelled" / "train.jsonl").write_text(
        "".join(json.dumps(dialog, ensure_ascii=False) + "\n" for dialog in unlabelled), encoding="utf-8"
    )
    for split, rows in intent.items():
        (staging / "intent" / f"{split}.csv").write_text(_csv(rows), encoding="utf-8")
    (staging / "intent" / "categories.json").write_text(json.dumps(categories(), indent=1) + "\n", encoding="utf-8")
    stats = {
        "domains": len(INTENTS),
        "intents": len(goals),
        "labelled_dialogs": len(labelled),
        "labelled_turns": sum(len(dialog["turns"]) for dialog in labelled.values()),
        "unlabelled_dialogs": len(unlabelled),
        "unlabelled_turns": sum(len(dialog["turns"]) for dialog in unlabelled),
        "intent_train": len(intent["train"]),
        "intent_test": len(intent["test"]),
        "pretrain_templates": sum(len(INTENTS[d][n].pretrain_templates) for d, n in goals),
        "heldout_templates": sum(len(INTENTS[d][n].heldout_templates) for d, n in goals),
        "seed": seed,
    }
    (staging / "stats.json").write_text(json.dumps(stats, indent=1) + "\n", encoding="utf-8")
    (staging / COMPLETE_MARKER).write_text(
        f"{stats['labelled_dialogs']} labelled, {stats['unlabelled_dialogs']} "
        f"unlabelled dialogs, {stats['intents']} intents\n"
    )
    if root.is_dir() and any(root.iterdir()) and not is_built(root):
        _replace_outputs(staging, root)  # a partial corpus from an interrupted build: overwrite its outputs
        return root
    return publish(staging, root)


def _replace_outputs(staging: Path, root: Path) -> None:
    """Move the staged outputs over those in `root`, the marker last; other files in `root` are left alone."""
    for child in sorted(staging.iterdir()):
        if child.name == COMPLETE_MARKER:
            continue
        target = root / child.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(child, target)
    os.replace(staging / COMPLETE_MARKER, root / COMPLETE_MARKER)
    staging.rmdir()


@register("dialogs")
def build_dialog_shards(root: str | os.PathLike, seed: int = 0) -> Path:
    """The corpus at `root` plus its training shards in `root/shards` (labelled-*.tar, unlabelled-*.tar)."""
    from mmpt.data.dialog import write_dialog_shards

    root = build_dialogs(root, seed)
    shards = root / "shards"
    if not (shards / COMPLETE_MARKER).is_file():
        shutil.rmtree(shards, ignore_errors=True)
        write_dialog_shards(
            shards,
            labelled=[root / "labelled" / "train.json"],
            unlabelled=[root / "unlabelled" / "train.jsonl"],
            shard_size=1000,
        )
        (shards / COMPLETE_MARKER).write_text("")
    return root
