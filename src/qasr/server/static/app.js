// The qasr page: upload or record audio, send it to /v1/audio/transcriptions, show the answer as it streams;
// or live captions of the microphone over the WebSocket /v1/stream.
// Plain browser JavaScript, no build step and nothing fetched from elsewhere.
"use strict";

const TRANSCRIBE_URL = "/v1/audio/transcriptions";
const MODELS_URL = "/v1/models";

const $ = (id) => document.getElementById(id);
let recorded = null;  // a Blob from the microphone, used instead of the file input when set
let recorder = null;
let canTimeWords = false;  // the server has a forced aligner (/v1/models says word_timestamps)
const TIMED_FORMATS = ["verbose_json", "srt", "vtt"];  // the formats that carry word times

function headers() {
  const key = $("apikey").value.trim();
  if (key) localStorage.setItem("qasr-api-key", key);
  return key ? { Authorization: "Bearer " + key } : {};
}

function setStatus(text, isError) {
  $("status").textContent = text;
  $("status").className = isError ? "error" : "";
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : response.statusText;
  } catch (e) {
    return response.statusText;
  }
}

// Server-sent events from a fetch body: split on blank lines, parse each "data:" line as JSON.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) onEvent(name, JSON.parse(data.join("\n")));
    }
  }
}

function audioToSend() {
  if (recorded) return { blob: recorded, name: "recording.webm" };
  const file = $("file").files[0];
  return file ? { blob: file, name: file.name } : null;
}

async function transcribe() {
  const audio = audioToSend();
  if (!audio) { setStatus("Choose a file or record first.", true); return; }
  const format = $("format").value;
  const stream = format === "stream";
  const form = new FormData();
  form.append("file", audio.blob, audio.name);
  form.append("model", $("model").dataset.id || "qasr");
  if ($("language").value) form.append("language", $("language").value);
  if ($("prompt").value) form.append("prompt", $("prompt").value);
  form.append("response_format", stream ? "json" : format);
  if (stream) form.append("stream", "true");
  const words = !$("words").disabled && $("words").checked;
  if (words) for (const g of ["word", "segment"]) form.append("timestamp_granularities[]", g);
  $("transcript").textContent = "";
  $("go").disabled = true;
  setStatus("Transcribing " + audio.name + " ...");
  const started = performance.now();
  try {
    const response = await fetch(TRANSCRIBE_URL, { method: "POST", body: form, headers: headers() });
    if (!response.ok) { setStatus(response.status + ": " + (await errorMessage(response)), true); return; }
    if (stream) {
      await readEvents(response, (name, event) => {
        if (name === "error") setStatus(event.error.message, true);
        else if (event.type === "transcript.text.delta") $("transcript").textContent += event.delta;
        else if (event.type === "transcript.text.done") {
          $("transcript").textContent = event.text;
          setStatus("Done in " + ((performance.now() - started) / 1000).toFixed(2) + " s.");
        }
      });
    } else {
      let body;
      if (format.endsWith("json")) {
        const answer = await response.json();
        body = (answer.words ? wordLines(answer.words) + "\n\n" : "") + JSON.stringify(answer, null, 2);
      } else {
        body = await response.text();
      }
      $("transcript").textContent = body;
      setStatus("Done in " + ((performance.now() - started) / 1000).toFixed(2) + " s.");
    }
  } catch (e) {
    setStatus("Request failed: " + e, true);
  } finally {
    $("go").disabled = false;
  }
}

// One line per word: its start and end in seconds, then the word.
function wordLines(words) {
  return words.map((w) => w.start.toFixed(2).padStart(7) + " " + w.end.toFixed(2).padStart(7) + "  " + w.word)
    .join("\n");
}

// The checkbox works only where word times exist: an aligner on the server and a format that shows them.
function updateWordsBox() {
  $("words").disabled = !(canTimeWords && TIMED_FORMATS.includes($("format").value));
}

async function toggleRecording() {
  if (recorder && recorder.state === "recording") { recorder.stop(); return; }
  let media;
  try {
    media = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    setStatus("No microphone: " + e, true);
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(media);
  recorder.ondataavailable = (e) => { if (e.data.size) chunks.push(e.data); };
  recorder.onstop = () => {
    media.getTracks().forEach((t) => t.stop());
    recorded = new Blob(chunks, { type: recorder.mimeType || "audio/webm" });
    $("record").textContent = "Record";
    $("recording").textContent = "recorded " + Math.round(recorded.size / 1024) + " KB (used instead of the file)";
  };
  recorder.start();
  $("record").textContent = "Stop";
  $("recording").textContent = "recording ...";
}

// Live captions: the microphone's samples go to /v1/stream as float32 PCM at the audio context's rate (the
// server resamples); each turn's stable text shows in black, its unstable tail in grey, finished turns stay.
const STREAM_URL = "/v1/stream";
let live = null;  // {ws, media, context, processor} while captions run

function liveSocket() {
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const key = $("apikey").value.trim();
  // a browser cannot set headers on a WebSocket: the key travels as a subprotocol, as OpenAI's clients send it
  const protocols = key ? ["qasr-stream", "openai-insecure-api-key." + key] : [];
  return new WebSocket(scheme + location.host + STREAM_URL, protocols);
}

async function toggleLive() {
  if (live) { stopLive(); return; }
  let media;
  try {
    media = await navigator.mediaDevices.getUserMedia(
      { audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false } });
  } catch (e) {
    setStatus("No microphone: " + e, true);
    return;
  }
  const context = new AudioContext();
  const source = context.createMediaStreamSource(media);
  // ScriptProcessor needs no separate module file (an AudioWorklet would); 4096 frames is ~85 ms at 48 kHz
  const processor = context.createScriptProcessor(4096, 1, 1);
  const ws = liveSocket();
  ws.binaryType = "arraybuffer";
  live = { ws, media, context, processor, ready: false };
  $("finals").textContent = "";
  $("stable").textContent = "";
  $("unstable").textContent = "";
  $("captions").hidden = false;
  $("live").textContent = "Stop captions";
  setStatus("Connecting ...");
  ws.onopen = () => ws.send(JSON.stringify({ type: "start", format: "float32", sample_rate: context.sampleRate,
    language: $("language").value || null, context: $("prompt").value }));
  ws.onmessage = (message) => onLiveMessage(JSON.parse(message.data));
  ws.onclose = () => { endLive(); };
  processor.onaudioprocess = (e) => {
    if (live && live.ready && ws.readyState === WebSocket.OPEN) ws.send(e.inputBuffer.getChannelData(0).slice().buffer);
  };
  source.connect(processor);
  processor.connect(context.destination);
}

function onLiveMessage(m) {
  if (m.type === "ready") { if (live) live.ready = true; setStatus("Listening ..."); }
  else if (m.type === "partial") { $("stable").textContent = m.stable; $("unstable").textContent = m.unstable; }
  else if (m.type === "final") {
    if (m.text) {  // one paragraph per finished turn
      const turn = document.createElement("p");
      turn.textContent = m.text;
      $("finals").appendChild(turn);
    }
    $("stable").textContent = "";
    $("unstable").textContent = "";
  } else if (m.type === "error") setStatus(m.message, true);
  else if (m.type === "done") setStatus("Live captions ended: " + m.turns + " turns, " + m.audio_seconds + " s.");
}

function stopLive() {
  if (!live) return;
  live.processor.disconnect();
  live.media.getTracks().forEach((t) => t.stop());
  if (live.ws.readyState === WebSocket.OPEN) live.ws.send(JSON.stringify({ type: "end" }));  // the server answers done
  $("live").textContent = "Live captions";
}

function endLive() {
  if (!live) return;
  live.processor.disconnect();
  live.media.getTracks().forEach((t) => t.stop());
  live.context.close();
  live = null;
  $("live").textContent = "Live captions";
}

async function showModel() {
  try {
    const response = await fetch(MODELS_URL, { headers: headers() });
    if (response.status === 401) {
      setStatus("This server needs an API key: type it above to list the model's languages.");
      return;
    }
    if (!response.ok) return;
    const first = (await response.json()).data[0];
    if (!first) return;
    $("model").textContent = "Model: " + first.id;
    $("model").dataset.id = first.id;
    if (first.languages) fillLanguages(first.languages);
    if ($("status").textContent.startsWith("This server needs an API key")) setStatus("");
    canTimeWords = first.word_timestamps === true;
    updateWordsBox();
  } catch (e) { /* the page still works without it */ }
}

function fillLanguages(names) {
  const select = $("language");
  while (select.options.length > 1) select.remove(1);  // keep "detect"
  for (const name of names) {
    const option = document.createElement("option");
    option.value = name;
    option.textContent = name;
    select.appendChild(option);
  }
}

function init() {
  $("apikey").value = localStorage.getItem("qasr-api-key") || "";
  // the language menu holds only "detect" until /v1/models lists the model's own languages
  $("file").addEventListener("change", () => { recorded = null; $("recording").textContent = ""; });
  $("record").addEventListener("click", toggleRecording);
  $("live").addEventListener("click", toggleLive);
  $("go").addEventListener("click", transcribe);
  $("format").addEventListener("change", updateWordsBox);
  $("apikey").addEventListener("change", showModel);
  showModel();
}

init();
