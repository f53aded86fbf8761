package zmqbridge

// Fuzz targets for the bridge's other inputs from outside the process: the
// raw ZMTP byte stream under the frame guard (FuzzZMTPScanner), the ZMQ
// frames around a batch (ParseLive, ParseReplay; the batch itself is
// FuzzDecodeBatch's), the engine's /metrics and /v1/models answers, the
// config file, and the bridge's own HTTP API.

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
)

// framesOf cuts fuzz bytes into ZMQ frames: each frame is a length byte and
// that many bytes (fewer at the end of the input), so any frame count and
// any frame content, empty frames included, is reachable.
func framesOf(data []byte) [][]byte {
	var frames [][]byte
	for len(data) > 0 {
		n := min(int(data[0]), len(data)-1)
		frames = append(frames, data[1:1+n])
		data = data[1+n:]
	}
	return frames
}

// frameBytes is framesOf's inverse, for seeds.
func frameBytes(frames ...[]byte) []byte {
	var b []byte
	for _, f := range frames {
		b = append(b, byte(len(f)))
		b = append(b, f...)
	}
	return b
}

func seqBytes(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// frameSeeds: the live and replay shapes of both vLLM generations and
// SGLang, the end markers, and near misses (short sequence frame, frames
// missing or extra).
func frameSeeds(tb testing.TB) [][]byte {
	payload := goldenFixtures(tb)["vllm_array_uint64"]
	seq, end := seqBytes(7), seqBytes(EndSeq)
	return [][]byte{
		frameBytes([]byte("kv-events"), seq, payload),
		frameBytes(nil, seq, payload),
		frameBytes([]byte("kv-events"), seq, nil),
		frameBytes(nil, []byte("kv-events"), seq, payload),
		frameBytes(nil, end, nil),
		frameBytes(nil, nil, end, nil),
		frameBytes(nil, end, payload),
		frameBytes(nil, []byte("kv"), end, payload),
		frameBytes(nil, seq[:3], payload),
		frameBytes(seq, payload),
		frameBytes(nil, nil, seq, nil, nil),
		frameBytes(nil),
		{},
	}
}

// FuzzParseLive: any frames parse or fail with ErrMalformed, never panic; a
// parsed message had exactly topic, an 8-byte big-endian sequence number
// and payload, and the Frame carries exactly those.
func FuzzParseLive(f *testing.F) {
	for _, s := range frameSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		frames := framesOf(data)
		fr, err := ParseLive(frames)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error does not wrap ErrMalformed: %v", err)
			}
			if len(frames) == 3 && len(frames[1]) == 8 {
				t.Fatalf("well-formed message rejected: %v", err)
			}
			return
		}
		if len(frames) != 3 || len(frames[1]) != 8 {
			t.Fatalf("%d frames accepted: %q", len(frames), frames)
		}
		if !bytes.Equal(fr.Topic, frames[0]) || fr.Seq != binary.BigEndian.Uint64(frames[1]) || !bytes.Equal(fr.Payload, frames[2]) {
			t.Fatalf("frames %q parsed as %+v", frames, fr)
		}
	})
}

// FuzzParseReplay: any frames parse, mark the end of the replay, or fail
// with ErrMalformed, never panic, and agree with the documented shapes:
// after an optional empty delimiter, an empty last frame or sequence number
// EndSeq ends the replay; otherwise seq+payload or topic+seq+payload with
// an 8-byte big-endian seq, carried into the Frame unchanged.
func FuzzParseReplay(f *testing.F) {
	for _, s := range frameSeeds(f) {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		frames := framesOf(data)
		fr, end, err := ParseReplay(frames)
		if err != nil {
			if !errors.Is(err, ErrMalformed) || end {
				t.Fatalf("error %v (end=%v) does not wrap ErrMalformed or claims the end", err, end)
			}
		}
		if end && !reflect.DeepEqual(fr, Frame{}) {
			t.Fatalf("end of replay with a frame: %+v", fr)
		}

		// The shapes as documented, independently of the parser.
		rest := frames
		if len(rest) > 0 && len(rest[0]) == 0 {
			rest = rest[1:]
		}
		var want Frame
		wantEnd, wantOK := false, true
		switch {
		case len(rest) > 0 && len(rest[len(rest)-1]) == 0:
			wantEnd = true
		case (len(rest) == 2 || len(rest) == 3) && len(rest[len(rest)-2]) == 8:
			want.Seq = binary.BigEndian.Uint64(rest[len(rest)-2])
			want.Payload = rest[len(rest)-1]
			if len(rest) == 3 {
				want.Topic = rest[0]
			}
			if want.Seq == EndSeq {
				want, wantEnd = Frame{}, true
			}
		default:
			wantOK = false
		}
		if (err == nil) != wantOK || end != wantEnd {
			t.Fatalf("frames %q: end=%v err=%v, want end=%v ok=%v", frames, end, err, wantEnd, wantOK)
		}
		if err == nil && !end && !reflect.DeepEqual(fr, want) {
			t.Fatalf("frames %q parsed as %+v, want %+v", frames, fr, want)
		}
	})
}

// metricsSeeds: the scrapes of real engines (vLLM's cache_config_info as
// the fake engine serves it, SGLang's gauges) plus broken lines.
var metricsSeeds = []string{
	"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n" +
		`vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="27024",num_gpu_blocks_override="None"} 1.0` + "\n" +
		`vllm:num_requests_running{engine="0",model_name="qwen3"} 0.0` + "\n",
	`vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="0",num_gpu_blocks="900"} 1.0` + "\n" +
		`vllm:cache_config_info{block_size="16",enable_prefix_caching="False",engine="1",num_gpu_blocks="800"} 1.0` + "\n",
	"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{model_name=\"q\"} 432000.0\nsglang:page_size{model_name=\"q\"} 16.0\n",
	"sglang:num_pages 27000\nsglang:page_size 16\nsglang:max_total_num_tokens 432000\n",
	"sglang:max_total_num_tokens 1e400\n",
	"sglang:num_pages NaN\n",
	`vllm:cache_config_info{block_size="16\",num_gpu_blocks="5"} 1` + "\n",
	`vllm:cache_config_info{block_size="1` + "\n",
	"vllm:cache_config_info{} \n{ 1\n 2\n",
	"",
}

// FuzzParseMetrics: any scrape body parses or fails, never panics; a
// failure names no engine, and what parses names vllm or sglang, with a
// capacity and a block size that are not negative (EngineInfo: 0 =
// unknown), for any router block size.
func FuzzParseMetrics(f *testing.F) {
	for _, s := range metricsSeeds {
		f.Add([]byte(s), 16)
	}
	f.Add([]byte(metricsSeeds[2]), 0)
	f.Add([]byte(metricsSeeds[2]), -16)
	f.Add([]byte(metricsSeeds[3]), 32)
	f.Fuzz(func(t *testing.T, body []byte, blockSize int) {
		info, err := ParseMetrics(body, blockSize)
		if err != nil {
			if info.Engine != "" {
				t.Fatalf("error %v with engine %q", err, info.Engine)
			}
			return
		}
		if info.Engine != "vllm" && info.Engine != "sglang" {
			t.Fatalf("engine %q", info.Engine)
		}
		if info.TotalBlocks < 0 || info.BlockSize < 0 {
			t.Fatalf("negative capacity or block size: %+v", info)
		}
	})
}

// FuzzProbeModel: any /v1/models answer yields a model id or an error,
// never a panic, and never an empty id without an error (the bridge would
// register the worker under no model).
func FuzzProbeModel(f *testing.F) {
	for _, s := range []string{
		`{"object":"list","data":[{"id":"Qwen/Qwen3-8B","object":"model","owned_by":"vllm"}]}`,
		`{"object":"list","data":[{"id":"a"},{"id":"b"}]}`,
		`{"object":"list","data":[]}`,
		`{"data":[{"id":""}]}`,
		`{"data":{"id":"x"}}`,
		`{"data":[null]}`,
		`[]`, `null`, ``, `{`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		client := &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
			return &http.Response{StatusCode: http.StatusOK, Header: http.Header{}, Body: io.NopCloser(bytes.NewReader(body))}, nil
		})}
		id, err := ProbeModel(context.Background(), client, "http://engine:8000/")
		if (err == nil) == (id == "") {
			t.Fatalf("ProbeModel = %q, %v", id, err)
		}
	})
}

// roundTripFunc answers requests in process: the probes under fuzz never
// touch the network.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// configSeeds: the README's fleet file, a minimal file, and files each
// Normalize or parse rule rejects.
var configSeeds = []string{
	`{
  "nats": "nats://router-1:4222",
  "register": ["http://router-1:8001"],
  "block_size": 16,
  "workers": [
    {"id": "gpu0", "url": "http://gpu0:8000", "events": "tcp://gpu0:5557", "replay": "tcp://gpu0:5558"},
    {"id": "gpu1", "url": "http://gpu1:8000", "events": "tcp://gpu1:5557", "replay": "tcp://gpu1:5558",
     "dp_ranks": 2, "model": "qwen3", "total_kv_blocks": 27024, "max_num_batched_tokens": 8192, "topic": ""}
  ]
}`,
	`{"workers":[{"id":" w ","url":" https://w:1/// ","events":"tcp://10.0.0.1:5557","metrics_url":"http://w:1/m"}]}`,
	`{"workers":[]}`,
	`{"workers":[{"id":"s","url":"http://s","events":"tcp://s:1","engine":" SGLang ","engine_version":"0.5.18.post1"},
	  {"id":"v","url":"http://v","events":"tcp://v:1","engine":"vllm","kv_cache_group":5},
	  {"id":"x","url":"http://x","events":"tcp://x:1","event_schema":"sglang-extra-keys","kv_cache_group":null}]}`,
	`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine":"vllm","event_schema":"sglang","kv_cache_group":-1}]}`,
	`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1","engine_version":"0.5.18","kv_cache_group":1.5}]}`,
	`{"admin_token":"t","workers":null}`,
	`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1"},{"id":"a","url":"http://a","events":"tcp://a:1"}]}`,
	`{"workers":[{"id":"a#0","url":"http://a","events":"tcp://a:1"}]}`,
	`{"workers":[{"id":"a","url":"ftp://a","events":"tcp://*:1","replay":"udp://a:1","dp_ranks":1025,"total_kv_blocks":-1}]}`,
	`{"workers":[{"id":"a","url":"http://a","events":"tcp://a:1"}],"block_size":-1}`,
	`{"workers":[],"unknown":1}`,
	`{"workers":[]} {}`,
	`{"workers":[]} x`,
	`[]`, `null`, ``, `{`,
}

// FuzzParseConfig: any config file parses or fails, never panics; what
// parses is valid as documented (no unknown keys, every worker passes
// Normalize, ids unique, block_size not negative) and normalised: its
// workers are fixed points of Normalize, and the config re-encoded as JSON
// parses back to itself. A rejected file yields the zero FileConfig.
func FuzzParseConfig(f *testing.F) {
	for _, s := range configSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			if !reflect.DeepEqual(c, FileConfig{}) {
				t.Fatalf("error %v with config %+v", err, c)
			}
			return
		}
		if c.BlockSize < 0 {
			t.Fatalf("block_size %d", c.BlockSize)
		}
		seen := map[string]bool{}
		for _, w := range c.Workers {
			again := w
			if err := again.Normalize(); err != nil || again != w {
				t.Fatalf("worker %+v is not normalised: %+v, %v", w, again, err)
			}
			if seen[w.ID] {
				t.Fatalf("worker %q twice", w.ID)
			}
			seen[w.ID] = true
		}
		enc, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		// Compared as JSON: an empty list and an absent one are the same
		// configuration ("register":[] re-encodes without the key).
		back, err := ParseConfig(enc)
		if err != nil {
			t.Fatalf("re-encoded config %s does not parse: %v", enc, err)
		}
		if enc2, _ := json.Marshal(back); !bytes.Equal(enc2, enc) {
			t.Fatalf("re-encoded config %s parses into %s", enc, enc2)
		}
	})
}

// FuzzBridgeHTTP drives the bridge's register and deregister endpoints
// with any body and Authorization header. The bridge is not running, so no
// accepted spec can start a worker (which would dial the fuzzed endpoints);
// a well-formed spec then gets the not-running error instead of 200.
// Invariants: no panic; a wrong token → 401 before the body is read; every
// answer is a JSON object, with a non-empty "error" for every non-200; a
// register body that does not decode (strictly: unknown keys are errors)
// or fails Normalize → 400 naming that failure; a deregister without an id
// → 400, with one → 404 (nothing is bridged); no worker is ever added.
func FuzzBridgeHTTP(f *testing.F) {
	for _, s := range []string{
		`{"id":"gpu0","url":"http://gpu0:8000","events":"tcp://gpu0:5557","replay":"tcp://gpu0:5558"}`,
		`{"id":"gpu1","url":"http://gpu1:8000","events":"tcp://gpu1:5557","dp_ranks":2,"model":"qwen3","total_kv_blocks":27024}`,
		`{"id":"","url":"http://a","events":"tcp://a:1"}`,
		`{"id":"a","url":"http://a","events":"tcp://a:99999"}`,
		`{"id":"a","url":"http://a","events":"tcp://a:1","extra":true}`,
		`{"id":"gpu0"}`, `{"id":""}`, `{"id":7}`,
		`[]`, `null`, ``, `{`,
	} {
		f.Add(false, []byte(s), "Bearer s3cret")
		f.Add(true, []byte(s), "Bearer s3cret")
	}
	f.Add(false, []byte(`{"id":"gpu0"}`), "")
	f.Add(true, []byte(`{"id":"gpu0"}`), "Bearer wrong")
	f.Add(true, []byte(`{"id":"gpu0"}`), "s3cret")
	f.Fuzz(func(t *testing.T, deregister bool, body []byte, auth string) {
		const token = "s3cret"
		b, err := New(Config{BlockSize: 16, Publishers: func(string, uint32) (Publisher, error) {
			return nil, errors.New("no publishing under fuzz")
		}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		path := "/workers/register"
		if deregister {
			path = "/workers/deregister"
		}
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body))
		req.Header.Set("Authorization", auth)
		rec := httptest.NewRecorder()
		b.Handler(nil, token).ServeHTTP(rec, req)

		var ans map[string]any
		if err := json.Unmarshal(rec.Body.Bytes(), &ans); err != nil {
			t.Fatalf("answer %d is not a JSON object: %q", rec.Code, rec.Body.Bytes())
		}
		msg, _ := ans["error"].(string)
		if rec.Code != http.StatusOK && msg == "" {
			t.Fatalf("status %d without an error: %q", rec.Code, rec.Body.Bytes())
		}
		if len(b.Status()) != 0 {
			t.Fatalf("a worker was added: %+v", b.Status())
		}
		if auth != "Bearer "+token {
			if rec.Code != http.StatusUnauthorized {
				t.Fatalf("token %q: status %d, want 401", auth, rec.Code)
			}
			return
		}

		if deregister {
			var d struct {
				ID string `json:"id"`
			}
			want := http.StatusNotFound
			if json.NewDecoder(bytes.NewReader(body)).Decode(&d) != nil || d.ID == "" {
				want = http.StatusBadRequest
			}
			if rec.Code != want {
				t.Fatalf("deregister %q: status %d (%s), want %d", body, rec.Code, msg, want)
			}
			return
		}
		var spec WorkerSpec
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.DisallowUnknownFields()
		decErr := dec.Decode(&spec)
		var normErr error
		if decErr == nil {
			normErr = spec.Normalize()
		}
		switch {
		case rec.Code != http.StatusBadRequest:
			t.Fatalf("register %q on a stopped bridge: status %d, want 400", body, rec.Code)
		case decErr != nil && !strings.HasPrefix(msg, "invalid JSON body: "):
			t.Fatalf("undecodable register %q answered %q", body, msg)
		case decErr == nil && normErr != nil && msg != normErr.Error():
			t.Fatalf("invalid spec %q answered %q, want %q", body, msg, normErr)
		case decErr == nil && normErr == nil && msg != "bridge: not running":
			t.Fatalf("valid spec %q answered %q, want the not-running error", body, msg)
		}
	})
}

// FuzzZMTPScanner feeds any byte stream after a greeting to the frame
// guard's scanner, in reads of any size, and checks it against a plain
// reference walk of the whole stream (zmq4's framing: flags, a 1- or
// 8-byte size, the body). Invariants: no panic; the read sizes never
// change the verdict; a stream is refused exactly when some header, once
// complete, declares more than is left of its message's cap (frames
// charged frameOverhead each); otherwise the whole messages counted agree.
// Seeds: issue 16's 2^50-byte header, a normal event message, a
// handshake, frames at and just over the cap.
func FuzzZMTPScanner(f *testing.F) {
	seeds := [][]byte{
		hugeHeader(),
		concat(zmtpReady(pubMeta()), zmtpFrame(zmtpMore, []byte("kv@gpu0")), zmtpFrame(zmtpMore, seqBytes(7)), zmtpFrame(0, []byte{0x93, 0xcb})),
		zmtpFrame(0, bytes.Repeat([]byte{1}, 300-frameOverhead)),
		zmtpFrame(0, bytes.Repeat([]byte{1}, 300-frameOverhead+1)),
		concat(zmtpFrame(zmtpMore, nil), zmtpFrame(zmtpMore, nil), zmtpFrame(zmtpMore, nil), zmtpFrame(zmtpMore, nil), zmtpFrame(0, nil)),
	}
	for _, s := range seeds {
		f.Add(s, uint8(0), uint16(300))
		f.Add(s, uint8(1), uint16(300))
	}
	f.Fuzz(func(t *testing.T, data []byte, chunk uint8, limit uint16) {
		stream := concat(zmtpGreeting(), data)
		wantRefused, wantMsgs := refScanZMTP(stream, int64(limit))
		s := newFrameScanner(int64(limit))
		var err error
		step := int(chunk) + 1
		for p := stream; len(p) > 0 && err == nil; {
			k := min(step, len(p))
			err = s.scan(p[:k])
			p = p[k:]
		}
		if err != nil && !errors.Is(err, ErrFrameTooLarge) {
			t.Fatalf("error %v", err)
		}
		if (err != nil) != wantRefused {
			t.Fatalf("reads of %d, cap %d: refused %v (%v), reference says %v", step, limit, err != nil, err, wantRefused)
		}
		if !wantRefused && s.messages != wantMsgs {
			t.Fatalf("%d messages, reference %d", s.messages, wantMsgs)
		}
	})
}

// refScanZMTP walks a whole stream the way zmq4's Conn.read does.
func refScanZMTP(stream []byte, limit int64) (refused bool, messages uint64) {
	p := stream[zmtpGreetingLen:]
	var used int64
	for len(p) > 0 {
		fl := p[0]
		p = p[1:]
		var size uint64
		if fl&zmtpLong != 0 {
			if len(p) < 8 {
				return false, messages
			}
			size, p = binary.BigEndian.Uint64(p), p[8:]
		} else {
			if len(p) < 1 {
				return false, messages
			}
			size, p = uint64(p[0]), p[1:]
		}
		left := limit - used - frameOverhead
		if left < 0 || size > uint64(left) {
			return true, messages
		}
		used += int64(size) + frameOverhead
		if uint64(len(p)) < size {
			return false, messages
		}
		p = p[size:]
		if fl&zmtpMore == 0 {
			messages++
			used = 0
		}
	}
	return false, messages
}
