"""JSON schemas of the shapes clients send as response_format or tool parameters (for tests)."""

from __future__ import annotations

_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}


def _obj(props: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required, **extra}


SCHEMAS: dict[str, dict] = {
    "flat_object": _obj({"name": _S, "age": _I, "active": _B}),
    "optional_fields": _obj({"title": _S, "subtitle": _S, "pages": _I}, required=["title"]),
    "no_extra_properties": _obj({"a": _S, "b": _I}, additionalProperties=False),
    "nested_object": _obj({"user": _obj({"id": _I, "profile": _obj({"nick": _S, "verified": _B})}), "ok": _B}),
    "deeply_nested": _obj({"a": _obj({"b": _obj({"c": _obj({"d": _I})})})}),
    "array_of_strings": _obj({"tags": {"type": "array", "items": _S}}),
    "array_bounds": _obj({"xs": {"type": "array", "items": _I, "minItems": 2, "maxItems": 4}}),
    "array_of_objects": _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": _obj({"sku": _S, "qty": {"type": "integer", "minimum": 1}})}}),
    "top_level_array": {"type": "array", "items": _obj({"k": _S}), "minItems": 1, "maxItems": 2},
    "tuple_prefix_items": _obj({"point": {"type": "array", "prefixItems": [_N, _N], "minItems": 2, "maxItems": 2}}),
    "string_enum": _obj({"status": {"enum": ["new", "paid", "shipped", "cancelled"]}}),
    "mixed_enum": _obj({"v": {"enum": ["auto", 1, 2.5, True, None]}}),
    "const": _obj({"kind": {"const": "invoice"}, "n": _I}),
    "any_of_types": _obj({"id": {"anyOf": [_S, _I]}}),
    "any_of_objects": _obj({"shape": {"anyOf": [_obj({"radius": _N}, additionalProperties=False),
                                                 _obj({"w": _N, "h": _N}, additionalProperties=False)]}}),
    "one_of_tagged": _obj({"pet": {"oneOf": [_obj({"type": {"const": "cat"}, "lives": _I}),
                                             _obj({"type": {"const": "dog"}, "good": _B})]}}),
    "nullable": _obj({"middle_name": {"type": ["string", "null"]}, "score": {"anyOf": [_N, {"type": "null"}]}}),
    "integer_range": _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "exclusive_range": _obj({"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
    "negative_range": _obj({"t": {"type": "integer", "minimum": -40, "maximum": -10}}),
    "string_lengths": _obj({"code": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "pattern": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
    "pattern_hex_color": _obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "format_ipv4": _obj({"ip": {"type": "string", "format": "ipv4"}}),
    "format_date_time": _obj({"at": {"type": "string", "format": "date-time"}}),
    "format_uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    "date_pattern": _obj({"day": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}),
    "defs_and_ref": {"$defs": {"addr": _obj({"street": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})},
                     **_obj({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}}, required=["home"])},
    "recursive_tree": {"$defs": {"node": _obj({"v": _I, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                                  "maxItems": 2}}, required=["v"])},
                       "$ref": "#/$defs/node"},
    "map_of_numbers": {"type": "object", "additionalProperties": _N, "maxProperties": 3},
    "all_of": {"allOf": [_obj({"a": _I}), _obj({"b": _S})]},
    "weather_tool": _obj({"city": _S, "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"]),
    "event": _obj({"title": {"type": "string", "maxLength": 40}, "when": {"type": "string", "format": "date-time"},
                   "where": {"anyOf": [_S, _obj({"lat": _N, "lon": _N})]},
                   "tags": {"type": "array", "items": _S, "maxItems": 4}}, required=["title", "when"]),
    "order": _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                   "lines": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": _obj({"sku": _S, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                            "price": {"type": "number", "minimum": 0}})},
                   "status": {"enum": ["new", "paid", "shipped"]}, "note": _S}, required=["id", "lines", "status"]),
}
