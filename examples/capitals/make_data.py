"""Writes train.jsonl and test.jsonl of the capitals example: a chat (a system turn that asks for the city's name
alone, a user turn that asks for a country's capital) and the accepted names of the capital; a country's split
is fixed by a hash of its name.

    python examples/capitals/make_data.py
"""

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).parent
SYSTEM = "Answer with the name of the city only."
# country: capital (alternative spellings after a |)
CAPITALS = {
    "Afghanistan": "Kabul", "Albania": "Tirana", "Algeria": "Algiers", "Angola": "Luanda", "Argentina": "Buenos Aires",
    "Armenia": "Yerevan", "Australia": "Canberra", "Austria": "Vienna", "Azerbaijan": "Baku", "Bahrain": "Manama",
    "Bangladesh": "Dhaka", "Belarus": "Minsk", "Belgium": "Brussels", "Bhutan": "Thimphu", "Botswana": "Gaborone",
    "Bulgaria": "Sofia", "Cambodia": "Phnom Penh", "Canada": "Ottawa", "Chile": "Santiago", "China": "Beijing",
    "Colombia": "Bogota", "Costa Rica": "San Jose", "Croatia": "Zagreb", "Cuba": "Havana", "Cyprus": "Nicosia",
    "the Czech Republic": "Prague", "Denmark": "Copenhagen", "the Dominican Republic": "Santo Domingo",
    "Ecuador": "Quito", "Egypt": "Cairo", "El Salvador": "San Salvador", "Estonia": "Tallinn",
    "Ethiopia": "Addis Ababa", "Fiji": "Suva", "Finland": "Helsinki", "France": "Paris", "Georgia": "Tbilisi",
    "Germany": "Berlin", "Ghana": "Accra", "Greece": "Athens", "Guatemala": "Guatemala City",
    "Haiti": "Port-au-Prince", "Honduras": "Tegucigalpa", "Hungary": "Budapest", "Iceland": "Reykjavik",
    "India": "New Delhi", "Indonesia": "Jakarta", "Iran": "Tehran", "Iraq": "Baghdad", "Ireland": "Dublin",
    "Italy": "Rome", "Jamaica": "Kingston", "Japan": "Tokyo", "Jordan": "Amman", "Kazakhstan": "Astana",
    "Kenya": "Nairobi", "Kuwait": "Kuwait City", "Kyrgyzstan": "Bishkek", "Laos": "Vientiane", "Latvia": "Riga",
    "Lebanon": "Beirut", "Liberia": "Monrovia", "Libya": "Tripoli", "Lithuania": "Vilnius",
    "Madagascar": "Antananarivo", "Malaysia": "Kuala Lumpur", "Mali": "Bamako", "Malta": "Valletta",
    "Mexico": "Mexico City", "Moldova": "Chisinau", "Mongolia": "Ulaanbaatar|Ulan Bator", "Montenegro": "Podgorica",
    "Morocco": "Rabat", "Mozambique": "Maputo", "Namibia": "Windhoek", "Nepal": "Kathmandu",
    "the Netherlands": "Amsterdam", "New Zealand": "Wellington", "Nicaragua": "Managua", "Nigeria": "Abuja",
    "North Korea": "Pyongyang", "North Macedonia": "Skopje", "Norway": "Oslo", "Oman": "Muscat",
    "Pakistan": "Islamabad", "Panama": "Panama City", "Papua New Guinea": "Port Moresby", "Peru": "Lima",
    "the Philippines": "Manila", "Poland": "Warsaw", "Portugal": "Lisbon", "Qatar": "Doha", "Romania": "Bucharest",
    "Russia": "Moscow", "Rwanda": "Kigali", "Saudi Arabia": "Riyadh", "Senegal": "Dakar", "Serbia": "Belgrade",
    "Sierra Leone": "Freetown", "Slovakia": "Bratislava", "Slovenia": "Ljubljana", "Somalia": "Mogadishu",
    "South Korea": "Seoul", "Spain": "Madrid", "Sudan": "Khartoum", "Sweden": "Stockholm", "Switzerland": "Bern",
    "Syria": "Damascus", "Tajikistan": "Dushanbe", "Thailand": "Bangkok", "Tunisia": "Tunis", "Turkey": "Ankara",
    "Turkmenistan": "Ashgabat", "Uganda": "Kampala", "Ukraine": "Kyiv|Kiev", "the United Kingdom": "London",
    "Uruguay": "Montevideo", "Uzbekistan": "Tashkent", "Venezuela": "Caracas", "Vietnam": "Hanoi",
    "Yemen": "Sanaa", "Zambia": "Lusaka", "Zimbabwe": "Harare",
}


def chat(country: str, capital: str) -> dict:
    """One example: the chat that asks, and the capital's accepted names (a list column)."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the capital of {country}?"}]
    return {"messages": messages, "capital": capital.split("|")}


def split(country: str) -> str:
    """test for about a third of the countries, train for the rest, by a hash of the name."""
    return "test" if int(hashlib.sha256(country.encode()).hexdigest()[:8], 16) % 3 == 0 else "train"


if __name__ == "__main__":
    for name in ("train", "test"):
        rows = [chat(c, capital) for c, capital in CAPITALS.items() if split(c) == name]
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{name}: {len(rows)} countries")
