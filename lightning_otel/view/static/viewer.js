// lightning-otel view: small progressive enhancements; every page works without this file.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  // Expand or collapse the whole span tree.
  const tree = document.getElementById("tree");
  if (tree) {
    const bar = document.createElement("p");
    for (const [label, open] of [["expand all", true], ["collapse all", false]]) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = label;
      button.addEventListener("click", () => tree.querySelectorAll("details").forEach((d) => { d.open = open; }));
      bar.appendChild(button);
    }
    tree.parentNode.insertBefore(bar, tree);
  }
  // A token's id, logprob, loss mask and advantage in a fixed box while the pointer is on it.
  const tokens = document.querySelectorAll(".tok.completion");
  if (tokens.length) {
    const info = document.createElement("div");
    info.id = "token-info";
    info.hidden = true;
    document.body.appendChild(info);
    tokens.forEach((t) => {
      t.addEventListener("mouseenter", () => { info.textContent = t.title; info.hidden = false; });
      t.addEventListener("mouseleave", () => { info.hidden = true; });
    });
  }
});
