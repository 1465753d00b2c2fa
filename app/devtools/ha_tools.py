"""Request bodies shaped like Home Assistant's voice assistant and AI Task (for tests and `hearth bench tools`).

The tools are Home Assistant's Assist intents as its LLM API sends them (voluptuous schemas turned
into JSON Schema: optional properties, enums of domains, integer ranges), the system prompt has its
shape (instructions, then the exposed devices as static context), and an AI Task schema has every
property required with nullable types as ["string", "null"].
"""

from __future__ import annotations

import random

_DOMAINS = ["light", "switch", "fan", "cover", "media_player", "climate", "lock", "vacuum", "valve", "scene", "script"]
_TARGET = {
    "name": {"type": "string"},
    "area": {"type": "string"},
    "floor": {"type": "string"},
    "domain": {"type": "array", "items": {"type": "string", "enum": _DOMAINS}},
    "device_class": {"type": "array", "items": {"type": "string", "enum": ["tv", "speaker", "receiver", "outlet",
                                                                           "switch", "awning", "blind", "curtain",
                                                                           "door", "garage", "gate", "shade",
                                                                           "shutter", "window", "water", "gas"]}},
}
_TIMER = {"start_hours": {"type": "integer", "minimum": 0, "maximum": 99},
          "start_minutes": {"type": "integer", "minimum": 0, "maximum": 999},
          "start_seconds": {"type": "integer", "minimum": 0, "maximum": 999},
          "name": {"type": "string"}, "area": {"type": "string"}}


def _tool(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required or []}}}


HA_TOOLS = [
    _tool("HassTurnOn", "Turns on/opens/presses a device or entity. For locks, this performs a 'lock' action.", _TARGET),
    _tool("HassTurnOff", "Turns off/closes a device or entity. For locks, this performs an 'unlock' action.", _TARGET),
    _tool("HassLightSet", "Sets the brightness percentage or color of a light",
          {**{k: v for k, v in _TARGET.items() if k != "device_class"},
           "color": {"type": "string"}, "temperature": {"type": "integer", "minimum": 0, "maximum": 1000},
           "brightness": {"type": "integer", "minimum": 0, "maximum": 100,
                          "description": "The brightness percentage of the light between 0 and 100"}}),
    _tool("HassSetPosition", "Sets the position of a device or entity",
          {**_TARGET, "position": {"type": "integer", "minimum": 0, "maximum": 100}}, ["position"]),
    _tool("HassMediaPause", "Pauses a media player", _TARGET),
    _tool("HassMediaUnpause", "Resumes a media player", _TARGET),
    _tool("HassMediaNext", "Skips a media player to the next item", _TARGET),
    _tool("HassMediaPrevious", "Replays the previous item for a media player", _TARGET),
    _tool("HassSetVolume", "Sets the volume percentage of a media player",
          {**_TARGET, "volume_level": {"type": "integer", "minimum": 0, "maximum": 100}}, ["volume_level"]),
    _tool("HassMediaSearchAndPlay", "Searches for media and plays the first result",
          {"search_query": {"type": "string"},
           "media_class": {"type": "string", "enum": ["album", "app", "artist", "movie", "music", "playlist",
                                                      "podcast", "tv_show", "track"]},
           "name": {"type": "string"}, "area": {"type": "string"}}, ["search_query"]),
    _tool("HassClimateSetTemperature", "Sets the target temperature of a climate device or entity",
          {"temperature": {"type": "number"}, "area": {"type": "string"}, "name": {"type": "string"},
           "floor": {"type": "string"}}, ["temperature"]),
    _tool("HassClimateGetTemperature", "Gets the current temperature of a climate device or entity",
          {"area": {"type": "string"}, "name": {"type": "string"}, "floor": {"type": "string"}}),
    _tool("HassStartTimer", "Starts a new timer",
          {**_TIMER, "conversation_command": {"type": "string"}}),
    _tool("HassCancelTimer", "Cancels a timer", _TIMER),
    _tool("HassCancelAllTimers", "Cancels all timers", {"area": {"type": "string"}}),
    _tool("HassTimerStatus", "Reports the current status of timers", _TIMER),
    _tool("HassListAddItem", "Add item to a todo list",
          {"item": {"type": "string"}, "name": {"type": "string"}}, ["item", "name"]),
    _tool("HassListCompleteItem", "Complete item on a todo list",
          {"item": {"type": "string"}, "name": {"type": "string"}}, ["item", "name"]),
    _tool("HassBroadcast", "Broadcast a message through the home", {"message": {"type": "string"}}, ["message"]),
    _tool("HassVacuumStart", "Starts a vacuum", {"name": {"type": "string"}, "area": {"type": "string"}}),
    _tool("GetDateTime", "Provides the current date and time.", {}),
    _tool("GetLiveContext", "Provides real-time information about the CURRENT state, value, or mode of devices, "
                            "sensors, entities, or areas. Use this tool for: 1. Answering questions about current "
                            "conditions (e.g., 'Is the light on?'). 2. As the first step in conditional actions.", {}),
]

HA_SYSTEM = """You are a voice assistant for Home Assistant.
Answer questions about the world truthfully.
Answer in plain text. Keep it simple and to the point.
When controlling Home Assistant always call the intent tools. Use HassTurnOn to lock and HassTurnOff to unlock a lock. When controlling a device, prefer passing just name and domain. When controlling an area, prefer passing just area name and domain.
When a user asks to turn on all devices of a specific type, ask user to specify an area, unless there is only one device of that type.
This device is not able to start timers.
You ARE equipped to answer questions about the current state of the home using the `GetLiveContext` tool.
Static Context: An overview of the areas and the devices in this smart home:
- names: Kitchen Light
  domain: light
  areas: Kitchen
- names: Living Room Lamp
  domain: light
  areas: Living Room
- names: Bedroom Fan
  domain: fan
  areas: Bedroom
- names: Front Door
  domain: lock
  areas: Hallway
- names: Living Room TV
  domain: media_player
  areas: Living Room
- names: Thermostat
  domain: climate
  areas: Hallway"""

HA_COMMANDS = [
    "Turn on the kitchen light", "Turn off the living room lamp", "Set the kitchen light to 40% brightness",
    "Turn on the bedroom fan", "Lock the front door", "Pause the TV", "Set the TV volume to 20",
    "Make the living room lamp red", "Set the thermostat to 21 degrees", "Is the kitchen light on?",
    "Add milk to the shopping list", "Turn off the bedroom fan", "Dim the kitchen light to 10 percent",
    "Skip to the next song on the living room TV", "What time is it?", "Turn off all lights in the kitchen",
    "Play some jazz in the living room", "Unlock the front door", "Resume the TV", "Start the vacuum",
]


def ha_chat_body(command: str, tool_choice: str | dict = "auto", stream: bool = True, history: bool = False,
                 tools: list[dict] | None = None) -> dict:
    """A chat request as Home Assistant's conversation agent sends it."""
    messages = [{"role": "system", "content": HA_SYSTEM}]
    if history:
        messages += [
            {"role": "user", "content": "Turn on the living room lamp"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "HassTurnOn", "arguments": '{"name": "Living Room Lamp", "domain": ["light"]}'}}]},
            {"role": "tool", "tool_call_id": "call_1",
             "content": '{"speech": {}, "response_type": "action_done", "data": {"targets": [], "success": '
                        '[{"name": "Living Room Lamp", "type": "entity", "id": "light.living_room_lamp"}], '
                        '"failed": []}}'},
            {"role": "assistant", "content": "The living room lamp is on."},
        ]
    messages.append({"role": "user", "content": command})
    body = {"messages": messages, "tools": tools or HA_TOOLS, "tool_choice": tool_choice, "stream": stream,
            "max_tokens": 300, "temperature": 0, "user": "01JABC"}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# Home Assistant's AI Task: every property required, nullable as a type list.
AI_TASK_SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "maxLength": 120, "description": "One sentence"},
        "room": {"type": ["string", "null"], "maxLength": 40},
        "priority": {"type": "string", "enum": ["low", "normal", "high"]},
        "people_count": {"type": ["integer", "null"]},
        "needs_attention": {"type": "boolean"},
    },
    "required": ["summary", "room", "priority", "people_count", "needs_attention"],
    "additionalProperties": False,
}

AI_TASK_PROMPTS = [
    "Summarise what the camera saw: a delivery driver left a parcel at the front door at 14:02.",
    "Describe the kitchen: two people are cooking and the oven is on.",
    "The garage door has been open for 3 hours and nobody is home.",
    "The living room is empty, the TV is off and the lights are dimmed.",
    "A smoke alarm went off in the bedroom and then stopped after a minute.",
]


def ai_task_body(prompt: str, stream: bool = False) -> dict:
    """An AI Task data-generation request with a strict schema."""
    return {"messages": [{"role": "user", "content": prompt}], "stream": stream, "max_tokens": 200, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "ai_task_data", "strict": True, "schema": AI_TASK_SCHEMA}}}


def sample_commands(n: int, seed: int = 0) -> list[str]:
    """n commands drawn from HA_COMMANDS (cycled, shuffled reproducibly)."""
    rng = random.Random(seed)
    out = [HA_COMMANDS[i % len(HA_COMMANDS)] for i in range(n)]
    rng.shuffle(out)
    return out
