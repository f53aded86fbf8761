package chattemplate

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"sort"
	"strconv"
	"strings"

	"github.com/ardanlabs/jinja"
)

// Object is a JSON object that keeps its keys in document order. Python
// dicts do, and templates show it: `tool | tojson` and `d.items()` emit keys
// in insertion order, so a Go map (unordered) would change the prompt.
type Object struct {
	keys []string
	vals map[string]any
}

// NewObject returns an empty Object.
func NewObject() *Object { return &Object{vals: map[string]any{}} }

// Set adds or replaces key; a new key goes last, a replaced one keeps its place.
func (o *Object) Set(key string, v any) {
	if _, ok := o.vals[key]; !ok {
		o.keys = append(o.keys, key)
	}
	o.vals[key] = v
}

// Get returns the value under key.
func (o *Object) Get(key string) (any, bool) {
	v, ok := o.vals[key]
	return v, ok
}

// Delete removes key, keeping the order of the others.
func (o *Object) Delete(key string) {
	if _, ok := o.vals[key]; !ok {
		return
	}
	delete(o.vals, key)
	for i, k := range o.keys {
		if k == key {
			o.keys = append(o.keys[:i:i], o.keys[i+1:]...)
			break
		}
	}
}

// Keys returns the keys in order. The caller must not modify the slice.
func (o *Object) Keys() []string { return o.keys }

// Len is the number of keys.
func (o *Object) Len() int { return len(o.keys) }

// clone copies the object one level deep.
func (o *Object) clone() *Object {
	c := &Object{keys: append([]string(nil), o.keys...), vals: make(map[string]any, len(o.vals))}
	for k, v := range o.vals {
		c.vals[k] = v
	}
	return c
}

// MarshalJSON writes the object with its keys in order.
func (o *Object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, k := range o.keys {
		if i > 0 {
			b.WriteByte(',')
		}
		kb, err := json.Marshal(k)
		if err != nil {
			return nil, err
		}
		b.Write(kb)
		b.WriteByte(':')
		vb, err := json.Marshal(o.vals[k])
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", k, err)
		}
		b.Write(vb)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// decodeJSON parses JSON the way Python's json.loads does: objects become
// *Object (key order kept; a repeated key keeps its first place and its last
// value), integers int64 (or *big.Int beyond 64 bits), other numbers
// float64, arrays []any.
func decodeJSON(data []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	v, err := decodeValue(d)
	if err != nil {
		return nil, err
	}
	if _, err := d.Token(); err != io.EOF {
		return nil, errors.New("trailing data after JSON value")
	}
	return v, nil
}

func decodeValue(d *json.Decoder) (any, error) {
	tok, err := d.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			o := NewObject()
			for d.More() {
				kt, err := d.Token()
				if err != nil {
					return nil, err
				}
				v, err := decodeValue(d)
				if err != nil {
					return nil, err
				}
				o.Set(kt.(string), v)
			}
			if _, err := d.Token(); err != nil {
				return nil, err
			}
			return o, nil
		case '[':
			l := []any{}
			for d.More() {
				v, err := decodeValue(d)
				if err != nil {
					return nil, err
				}
				l = append(l, v)
			}
			if _, err := d.Token(); err != nil {
				return nil, err
			}
			return l, nil
		}
		return nil, fmt.Errorf("unexpected %v", t)
	case json.Number:
		return parseNumber(t)
	default:
		return t, nil // string, bool or nil
	}
}

func parseNumber(n json.Number) (any, error) {
	s := string(n)
	if !strings.ContainsAny(s, ".eE") {
		if i, err := n.Int64(); err == nil {
			return i, nil
		}
		b, ok := new(big.Int).SetString(s, 10)
		if !ok {
			return nil, fmt.Errorf("bad integer %q", s)
		}
		return b, nil
	}
	f, err := n.Float64()
	if err != nil {
		// Python turns an out-of-range float literal into inf; so do we.
		var ne *strconv.NumError
		if errors.As(err, &ne) {
			return f, nil
		}
		return nil, fmt.Errorf("bad number %q: %w", s, err)
	}
	return f, nil
}

// toJinja converts a template variable to the engine's value. Go maps have
// no order, so their keys are sorted to keep renders deterministic; callers
// that care about order pass *Object.
func toJinja(v any) (jinja.Value, error) {
	switch x := v.(type) {
	case nil:
		return jinja.None(), nil
	case jinja.Value:
		return x, nil
	case *Object:
		d := jinja.NewDict()
		dict := d.AsDict()
		for _, k := range x.keys {
			jv, err := toJinja(x.vals[k])
			if err != nil {
				return jinja.Value{}, fmt.Errorf("key %q: %w", k, err)
			}
			dict.Set(k, jv)
		}
		return d, nil
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		o := &Object{keys: keys, vals: x}
		return toJinja(o)
	case map[string]string:
		o := NewObject()
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			o.Set(k, x[k])
		}
		return toJinja(o)
	case []any:
		items := make([]jinja.Value, len(x))
		for i, e := range x {
			jv, err := toJinja(e)
			if err != nil {
				return jinja.Value{}, fmt.Errorf("item %d: %w", i, err)
			}
			items[i] = jv
		}
		return jinja.NewList(items), nil
	case []string:
		items := make([]jinja.Value, len(x))
		for i, e := range x {
			items[i] = jinja.NewString(e)
		}
		return jinja.NewList(items), nil
	case []*Object:
		items := make([]jinja.Value, len(x))
		for i, e := range x {
			jv, err := toJinja(e)
			if err != nil {
				return jinja.Value{}, fmt.Errorf("item %d: %w", i, err)
			}
			items[i] = jv
		}
		return jinja.NewList(items), nil
	case string:
		return jinja.NewString(x), nil
	case bool:
		return jinja.NewBool(x), nil
	case int:
		return jinja.NewInt(int64(x)), nil
	case int64:
		return jinja.NewInt(x), nil
	case float64:
		return jinja.NewFloat(x), nil
	case *big.Int:
		return jinja.Value{}, fmt.Errorf("integer %s does not fit in 64 bits", x)
	case json.Number:
		n, err := parseNumber(x)
		if err != nil {
			return jinja.Value{}, err
		}
		return toJinja(n)
	}
	return jinja.Value{}, fmt.Errorf("unsupported template value of type %T", v)
}

// errUndefinedJSON is Python's answer to json.dumps(Undefined).
var errUndefinedJSON = errors.New("TypeError: Object of type Undefined is not JSON serializable")

// fromJinja converts an engine value back to plain data for tojson.
func fromJinja(v jinja.Value) (any, error) {
	switch {
	case v.IsUndefined():
		return nil, errUndefinedJSON
	case v.IsNone():
		return nil, nil
	case v.IsBool():
		return v.AsBool(), nil
	case v.IsInt():
		return v.AsInt(), nil
	case v.IsFloat():
		return v.AsFloat(), nil
	case v.IsString():
		return v.AsString(), nil
	case v.IsList():
		items := v.AsList().Items
		out := make([]any, len(items))
		for i, e := range items {
			x, err := fromJinja(e)
			if err != nil {
				return nil, err
			}
			out[i] = x
		}
		return out, nil
	case v.IsDict():
		d := v.AsDict()
		o := NewObject()
		for _, k := range d.OrderedKeys() {
			e, _ := d.Get(k)
			x, err := fromJinja(e)
			if err != nil {
				return nil, err
			}
			o.Set(k, x)
		}
		return o, nil
	}
	return nil, fmt.Errorf("TypeError: Object of type %s is not JSON serializable", v.String())
}
